//! The chunk table: chunk id → where the chunk's record is, its fingerprint and its reference
//! count.
//!
//! Owns: the authoritative location of every chunk (with the block maps, it decides what a
//! block contains), the reference counts, and the per-segment live byte counts that GC reads.
//! Stored as a paged copy-on-write tree ([`crate::page_cache`], tree [`CHUNK_TREE`]) of
//! 32-byte records, 128 to a page: fingerprint (16), segment (4), offset (4), length and codec
//! (4), references (4). A record whose length/codec word is 0 is free.
//! A slot may be a **forward** instead ([`Slot::Forward`], made by the merge pass,
//! [`ChunkTable::forward`]): a chunk found to duplicate an older one, whose blocks read that
//! one's record. [`ChunkTable::get`] resolves it; walks of records never see it.
//! Invariants:
//! - `refs` equals the number of block-map entries naming the chunk, plus the delta chunks
//!   (`NewDelta`, docs/FORMAT.md "Delta records") naming it as a base until they are dropped
//!   (`DropDelta`), plus, for a chunk forwards point to, the `refs` of each of them (a forward's own count is the entries
//!   naming it); changes to it are made only by applying journal records, so replay
//!   reproduces them.
//! - A forward points to a chunk with a record and the same fingerprint, never to another
//!   forward; a forward whose count falls to 0 is freed at once (it has no record).
//! - Ids are handed out in increasing order and never reused (48 bits last forever), so the
//!   table is ordered by time of writing: chunks written together share pages.
//! - The counters (`live_chunks`, `live_stored_bytes`, live bytes per segment) change with
//!   every reference taken or dropped and are saved in the checkpoint root.

use crate::page_cache::{PageCache, CHUNK_TREE};
use condense_format::chunk_slot::encode_forward;
pub use condense_format::chunk_slot::encode_slot;
pub use condense_format::chunk_slot::{decode_any, decode_slot, slots_with_fp, ChunkEntry, Slot};
use condense_format::error::{Error, Result};
use condense_format::{Fingerprint, Location, CHUNKS_PER_PAGE, CHUNK_ID_LIMIT};
use std::collections::HashMap;

const PER: u64 = CHUNKS_PER_PAGE as u64;

/// `ids` cut into runs of consecutive ids on one chunk-table page, in order.
fn same_page_runs(ids: &[u64]) -> impl Iterator<Item = &[u64]> {
    ids.chunk_by(|&a, &b| page_of(a) == page_of(b))
}

/// The page of chunk `id`.
pub fn page_of(id: u64) -> u64 {
    id / PER
}

/// Counters and id allocation; the records themselves live in the page cache.
#[derive(Clone, Debug, Default)]
pub struct ChunkTable {
    pub next_id: u64,
    /// Bytes of records of chunks with refs > 0, per segment.
    pub live_bytes: HashMap<u32, u64>,
    pub live_chunks: u64,
    pub live_stored_bytes: u64,
    /// Forwards made over the pool's life; `None` until the pool allows them (saved in the
    /// root; see `Root::forwards`).
    pub forwards: Option<u64>,
    /// Delta records made over the pool's life; `None` until the pool allows them (saved in
    /// the root; see `Root::deltas`).
    pub deltas: Option<u64>,
}

/// What [`ChunkTable::forward`] changed: the references the forward took over, and the
/// stored payload lengths of the chunk forwarded and of its target.
#[derive(Clone, Copy, Debug)]
pub struct Forwarded {
    pub refs: u32,
    pub stored_from: u32,
    pub stored_to: u32,
}

impl ChunkTable {
    /// The next id, or None when all ids are taken.
    pub fn allocate_id(&mut self) -> Option<u64> {
        if self.next_id >= CHUNK_ID_LIMIT {
            return None;
        }
        self.next_id += 1;
        Some(self.next_id - 1)
    }

    /// Give back the last ids handed out (a batch that failed before it was applied).
    pub fn unallocate_to(&mut self, id: u64) {
        self.next_id = self.next_id.min(id);
    }

    /// The chunk whose record blocks naming `id` read: `id`'s own, or the one it forwards to
    /// (that chunk's entry; its `refs` count the forward's too).
    pub fn get(&self, cache: &mut PageCache, id: u64) -> Result<Option<ChunkEntry>> {
        Ok(self.resolve(cache, id)?.map(|(_, e)| e))
    }

    /// [`ChunkTable::get`] with the id of the chunk found.
    pub fn resolve(&self, cache: &mut PageCache, id: u64) -> Result<Option<(u64, ChunkEntry)>> {
        match self.slot(cache, id)? {
            Some(Slot::Chunk(e)) => Ok(Some((id, e))),
            Some(Slot::Forward { to, .. }) => match self.slot(cache, to)? {
                Some(Slot::Chunk(e)) => Ok(Some((to, e))),
                _ => Err(Error::corrupt(
                    "chunk table",
                    format!("chunk {id} forwards to chunk {to}, which has no record"),
                )),
            },
            None => Ok(None),
        }
    }

    /// [`ChunkTable::resolve`] of many ids at once, each answered as (the id of the chunk
    /// found, its stored length), or (`id`, 0) for a free slot; in the order of `ids`. A run
    /// of ids on one chunk-table page (a map's entries name runs of ids written together)
    /// finds the page once; forwards are then resolved one by one.
    pub fn resolve_lens(&self, cache: &mut PageCache, ids: &[u64]) -> Result<Vec<(u64, u32)>> {
        let mut out = Vec::with_capacity(ids.len());
        let mut forwards = Vec::new();
        for run in same_page_runs(ids) {
            let page = match run.iter().any(|&id| id < self.next_id) {
                true => cache.leaf(CHUNK_TREE, page_of(run[0]))?,
                false => None,
            };
            for &id in run {
                let slot = page.filter(|_| id < self.next_id);
                out.push(
                    match slot.and_then(|p| decode_any(p, (id % PER) as usize)) {
                        Some(Slot::Chunk(e)) => (id, e.loc.stored_len),
                        Some(Slot::Forward { .. }) => {
                            forwards.push(out.len());
                            (id, 0)
                        }
                        None => (id, 0),
                    },
                );
            }
        }
        for i in forwards {
            if let Some((rid, e)) = self.resolve(cache, ids[i])? {
                out[i] = (rid, e.loc.stored_len);
            }
        }
        Ok(out)
    }

    /// Slot `id` as stored: a chunk, a forward, or `None` (free).
    pub fn slot(&self, cache: &mut PageCache, id: u64) -> Result<Option<Slot>> {
        if id >= self.next_id {
            return Ok(None);
        }
        Ok(cache
            .leaf(CHUNK_TREE, page_of(id))?
            .and_then(|p| decode_any(p, (id % PER) as usize)))
    }

    /// Make chunk `id` a forward to chunk `to` (same fingerprint, both with a record): `to`
    /// takes over `id`'s references, `id`'s record is dead from now on (GC reclaims it).
    pub fn forward(&mut self, cache: &mut PageCache, id: u64, to: u64) -> Result<Forwarded> {
        let bad = |why: String| {
            Err(Error::corrupt(
                "journal",
                format!("forward of chunk {id} to chunk {to}: {why}"),
            ))
        };
        let (Some(Slot::Chunk(from)), Some(Slot::Chunk(target))) =
            (self.slot(cache, id)?, self.slot(cache, to)?)
        else {
            return bad("both must be chunks with a record".into());
        };
        if id == to || from.fp != target.fp {
            return bad("not the same chunk".into());
        }
        if from.loc.codec.is_delta() || target.loc.codec.is_delta() {
            // A delta's record holds references on its bases that only its drop gives back,
            // and a base must not read a delta: the merge pass leaves deltas alone.
            return bad("a delta is never forwarded nor forwarded to".into());
        }
        cache.grow_tree(CHUNK_TREE, page_of(id) + 1)?;
        let page = cache.leaf_mut(CHUNK_TREE, page_of(id))?;
        let i = (id % PER) as usize;
        if from.refs == 0 {
            encode_slot(page, i, None);
        } else {
            encode_forward(page, i, &from.fp, to, from.refs);
            self.account(&from, false);
        }
        let refs = from.refs;
        self.update(cache, to, |old| {
            Ok(old.map(|e| ChunkEntry {
                refs: e.refs.saturating_add(refs),
                ..e
            }))
        })?;
        if target.refs == 0 && refs > 0 {
            self.account(&target, true);
        }
        *self.forwards.get_or_insert(0) += 1;
        Ok(Forwarded {
            refs,
            stored_from: from.loc.stored_len,
            stored_to: target.loc.stored_len,
        })
    }

    /// If slot `id` is a forward: its count one up (`up`) or down (a forward reaching 0 is
    /// freed), and the chunk it forwards to. `None`: not a forward.
    fn step_forward(&mut self, cache: &mut PageCache, id: u64, up: bool) -> Result<Option<u64>> {
        let Some(Slot::Forward { fp, to, refs }) = self.slot(cache, id)? else {
            return Ok(None);
        };
        let refs = match (up, refs) {
            (true, n) => n.saturating_add(1),
            (false, 0) => {
                return Err(Error::corrupt(
                    "chunk table",
                    format!("forward {id} dereferenced below zero"),
                ))
            }
            (false, n) => n - 1,
        };
        let page = cache.leaf_mut(CHUNK_TREE, page_of(id))?;
        let i = (id % PER) as usize;
        if refs == 0 {
            encode_slot(page, i, None);
        } else {
            encode_forward(page, i, &fp, to, refs);
        }
        Ok(Some(to))
    }

    /// Make sure the page of `id` is in memory (a later change does no I/O).
    pub fn prefetch(&self, cache: &mut PageCache, id: u64) -> Result<()> {
        cache.grow_tree(CHUNK_TREE, page_of(id) + 1)?;
        cache.prefetch(CHUNK_TREE, page_of(id))
    }

    fn update(
        &mut self,
        cache: &mut PageCache,
        id: u64,
        f: impl FnOnce(Option<ChunkEntry>) -> Result<Option<ChunkEntry>>,
    ) -> Result<(Option<ChunkEntry>, Option<ChunkEntry>)> {
        cache.grow_tree(CHUNK_TREE, page_of(id) + 1)?;
        let page = cache.leaf_mut(CHUNK_TREE, page_of(id))?;
        let i = (id % PER) as usize;
        let old = decode_slot(page, i);
        let new = f(old)?;
        encode_slot(page, i, new.as_ref());
        self.next_id = self.next_id.max(id + 1);
        Ok((old, new))
    }

    fn account(&mut self, e: &ChunkEntry, add: bool) {
        let bytes = e.loc.record_bytes();
        let seg = self.live_bytes.entry(e.loc.segment).or_insert(0);
        if add {
            *seg += bytes;
            self.live_chunks += 1;
            self.live_stored_bytes += u64::from(e.loc.stored_len);
        } else {
            *seg = seg.saturating_sub(bytes);
            if *seg == 0 {
                self.live_bytes.remove(&e.loc.segment);
            }
            self.live_chunks = self.live_chunks.saturating_sub(1);
            self.live_stored_bytes = self
                .live_stored_bytes
                .saturating_sub(u64::from(e.loc.stored_len));
        }
    }

    /// Put a new chunk (no references yet) into slot `id`.
    pub fn insert(
        &mut self,
        cache: &mut PageCache,
        id: u64,
        fp: Fingerprint,
        loc: &Location,
    ) -> Result<()> {
        self.update(cache, id, |old| match old {
            Some(_) => Err(Error::corrupt(
                "journal",
                format!("chunk {id} is created twice"),
            )),
            None => Ok(Some(ChunkEntry {
                fp,
                loc: *loc,
                refs: 0,
            })),
        })
        .map(drop)
    }

    /// Move chunk `id` to `loc`; returns its payload length before the move.
    pub fn relocate(&mut self, cache: &mut PageCache, id: u64, loc: &Location) -> Result<u32> {
        let (old, new) = self.update(cache, id, |old| match old {
            None => Err(Error::corrupt(
                "journal",
                format!("relocation of chunk {id}, which does not exist"),
            )),
            Some(e) => Ok(Some(ChunkEntry { loc: *loc, ..e })),
        })?;
        if let (Some(old), Some(new)) = (old, new) {
            if old.refs > 0 {
                self.account(&old, false);
                self.account(&new, true);
            }
        }
        Ok(old.map_or(0, |o| o.loc.stored_len))
    }

    /// Forget chunk `id` (it has no references).
    pub fn remove(&mut self, cache: &mut PageCache, id: u64) -> Result<()> {
        if let Some(Slot::Forward { refs, .. }) = self.slot(cache, id)? {
            return Err(Error::corrupt(
                "journal",
                format!("chunk {id} dropped while it forwards {refs} blocks"),
            ));
        }
        self.update(cache, id, |old| match old {
            Some(e) if e.refs > 0 => Err(Error::corrupt(
                "journal",
                format!("chunk {id} dropped while {} blocks refer to it", e.refs),
            )),
            _ => Ok(None),
        })
        .map(drop)
    }

    /// Take a reference; returns the id of the chunk whose record it reads (`id`, or the
    /// one `id` forwards to) and that record's payload length.
    pub fn incref(&mut self, cache: &mut PageCache, id: u64) -> Result<(u64, u32)> {
        let id = self.step_forward(cache, id, true)?.unwrap_or(id);
        let (old, new) = self.update(cache, id, |old| match old {
            None => Err(Error::corrupt(
                "block map",
                format!("a block refers to chunk {id}, which does not exist"),
            )),
            // Saturating: a count stuck at the maximum only keeps the chunk forever, never
            // frees it early. The write path stops sharing a chunk long before (REFS_MAX).
            Some(e) => Ok(Some(ChunkEntry {
                refs: e.refs.saturating_add(1),
                ..e
            })),
        })?;
        if let (Some(o), Some(n)) = (old, new) {
            if o.refs == 0 {
                self.account(&n, true);
            }
        }
        Ok((id, new.map_or(0, |n| n.loc.stored_len)))
    }

    /// Drop a reference; returns the id of the chunk whose record it read and that record's
    /// payload length (see [`ChunkTable::incref`]).
    pub fn decref(&mut self, cache: &mut PageCache, id: u64) -> Result<(u64, u32)> {
        let id = self.step_forward(cache, id, false)?.unwrap_or(id);
        let (old, new) = self.update(cache, id, |old| match old {
            None => Err(Error::corrupt(
                "block map",
                format!("a block referred to chunk {id}, which does not exist"),
            )),
            Some(e) if e.refs == 0 => Err(Error::corrupt(
                "chunk table",
                format!("chunk {id} dereferenced below zero"),
            )),
            Some(e) => Ok(Some(ChunkEntry {
                refs: e.refs - 1,
                ..e
            })),
        })?;
        if let Some(n) = new {
            if n.refs == 0 {
                self.account(&n, false);
            }
        }
        let _ = old;
        Ok((id, new.map_or(0, |n| n.loc.stored_len)))
    }

    /// [`ChunkTable::decref`] of many ids (the entries of released leaves): a run of ids on
    /// one chunk-table page finds and changes the page once; forwards go then one by one.
    /// The same result as one decref per id in any order; an id that is no chunk, or a
    /// count that would go below zero, fails as there.
    pub fn decref_many(&mut self, cache: &mut PageCache, ids: &[u64]) -> Result<()> {
        let (mut forwards, mut freed) = (Vec::new(), Vec::new());
        for run in same_page_runs(ids) {
            let page_no = page_of(run[0]);
            cache.grow_tree(CHUNK_TREE, page_no + 1)?;
            let page = cache.leaf_mut(CHUNK_TREE, page_no)?;
            for &id in run {
                let i = (id % PER) as usize;
                match decode_any(page, i) {
                    Some(Slot::Forward { .. }) => forwards.push(id),
                    Some(Slot::Chunk(e)) if e.refs > 0 => {
                        let n = ChunkEntry {
                            refs: e.refs - 1,
                            ..e
                        };
                        encode_slot(page, i, Some(&n));
                        if n.refs == 0 {
                            freed.push(n);
                        }
                    }
                    Some(Slot::Chunk(_)) => {
                        return Err(Error::corrupt(
                            "chunk table",
                            format!("chunk {id} dereferenced below zero"),
                        ))
                    }
                    None => {
                        return Err(Error::corrupt(
                            "block map",
                            format!("a block referred to chunk {id}, which does not exist"),
                        ))
                    }
                }
            }
        }
        for n in freed {
            self.account(&n, false);
        }
        for id in forwards {
            self.decref(cache, id)?;
        }
        Ok(())
    }

    /// The live chunks and their stored payload bytes (`record_bytes()`: what the segments
    /// hold live).
    pub fn live(&self) -> crate::attribution::Space {
        crate::attribution::Space {
            chunks: self.live_chunks,
            stored_bytes: self.live_stored_bytes,
        }
    }

    /// Live bytes of records in `segment`.
    pub fn segment_live_bytes(&self, segment: u32) -> u64 {
        self.live_bytes.get(&segment).copied().unwrap_or(0)
    }

    /// Visit every chunk: (id, entry). Pages are read without filling the cache.
    pub fn for_each(
        &self,
        cache: &mut PageCache,
        f: &mut dyn FnMut(u64, &ChunkEntry) -> Result<()>,
    ) -> Result<()> {
        self.for_each_in(cache, 0, u64::MAX, f)
    }

    /// Visit the forwards of every page: (id, the chunk it forwards to).
    pub fn for_each_forward(
        &self,
        cache: &mut PageCache,
        f: &mut dyn FnMut(u64, u64) -> Result<()>,
    ) -> Result<()> {
        cache.for_each_leaf(CHUNK_TREE, 0, u64::MAX, &mut |pi, page| {
            for i in 0..CHUNKS_PER_PAGE {
                if let Some(Slot::Forward { to, .. }) = decode_any(page, i) {
                    f(pi * PER + i as u64, to)?;
                }
            }
            Ok(true)
        })
    }

    /// Visit the chunks of pages `[first_page, end_page)`: (id, entry).
    pub fn for_each_in(
        &self,
        cache: &mut PageCache,
        first_page: u64,
        end_page: u64,
        f: &mut dyn FnMut(u64, &ChunkEntry) -> Result<()>,
    ) -> Result<()> {
        cache.for_each_leaf(CHUNK_TREE, first_page, end_page, &mut |pi, page| {
            for i in 0..CHUNKS_PER_PAGE {
                if let Some(e) = decode_slot(page, i) {
                    f(pi * PER + i as u64, &e)?;
                }
            }
            Ok(true)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page_alloc::PageAlloc;
    use condense_format::ChunkCodec;
    use std::collections::BTreeMap;

    fn cache() -> Result<PageCache> {
        let dir = condense_store::sim::SimHandle(condense_store::sim::SimDir::new());
        let file = condense_store::io::Dir::open(&dir, "meta.dat", true)
            .map_err(|e| Error::io("opening meta.dat", e))?;
        let mut c = PageCache::new(
            file,
            PageAlloc::from_bitmap(Vec::new()),
            BTreeMap::new(),
            1 << 20,
        );
        c.create_tree(CHUNK_TREE, 1);
        Ok(c)
    }

    fn loc(segment: u32) -> Location {
        Location {
            segment,
            offset: 64,
            stored_len: 100,
            codec: ChunkCodec::Lz4,
        }
    }

    /// Many references dropped at once leave the table as one drop each would.
    #[test]
    fn many_decrefs_at_once_are_one_by_one() -> Result<()> {
        let per = CHUNKS_PER_PAGE as u64;
        let ids = [0, 1, 5, per, per + 7, 3 * per + 2, 3 * per + 3];
        let tables = || -> Result<(PageCache, ChunkTable)> {
            let (mut c, mut t) = (cache()?, ChunkTable::default());
            for (k, &id) in ids.iter().enumerate() {
                t.insert(&mut c, id, [id as u8; 16], &loc(1 + k as u32 % 2))?;
                for _ in 0..=k % 3 {
                    t.incref(&mut c, id)?;
                }
            }
            t.insert(&mut c, 9, [0; 16], &loc(2))?;
            t.incref(&mut c, 9)?;
            t.incref(&mut c, 9)?;
            t.forward(&mut c, 9, 0)?;
            Ok((c, t))
        };
        // Out of order, a forward named twice (to zero; its target loses both), some chunks
        // to zero.
        let drops = [per + 7, 0, 9, 5, 3 * per + 3, 1, 9, per, 3 * per + 2];
        let (mut c1, mut one) = tables()?;
        for &id in &drops {
            one.decref(&mut c1, id)?;
        }
        let (mut c2, mut many) = tables()?;
        many.decref_many(&mut c2, &drops)?;
        assert_eq!(many.live(), one.live());
        assert_eq!(many.live_bytes, one.live_bytes);
        for id in ids.iter().copied().chain([9]) {
            let a = one.slot(&mut c1, id)?;
            assert_eq!(many.slot(&mut c2, id)?, a, "chunk {id}");
        }
        // Below zero, or no chunk at all: refused.
        assert!(many.decref_many(&mut c2, &[0]).is_err());
        assert!(many.decref_many(&mut c2, &[2]).is_err());
        Ok(())
    }

    /// Many ids looked up at once answer as one lookup each would.
    #[test]
    fn many_ids_resolve_as_one_by_one() -> Result<()> {
        let (mut c, mut t) = (cache()?, ChunkTable::default());
        let per = CHUNKS_PER_PAGE as u64;
        for id in [0, 1, 5, per, per + 7, 3 * per + 2] {
            let mut l = loc(1);
            l.stored_len = 100 + id as u32;
            t.insert(&mut c, id, [id as u8; 16], &l)?;
            t.incref(&mut c, id)?;
        }
        t.insert(&mut c, 3 * per + 3, [0; 16], &loc(2))?;
        t.incref(&mut c, 3 * per + 3)?;
        t.forward(&mut c, 3 * per + 3, 0)?;
        // Out of order, repeated, a free slot, a forward, past the last id.
        let ids = [
            per + 7,
            0,
            2,
            3 * per + 3,
            5,
            per,
            0,
            3 * per + 2,
            9 * per,
            1,
        ];
        let many = t.resolve_lens(&mut c, &ids)?;
        for (&id, &got) in ids.iter().zip(&many) {
            let one = t
                .resolve(&mut c, id)?
                .map_or((id, 0), |(rid, e)| (rid, e.loc.stored_len));
            assert_eq!(got, one, "chunk {id}");
        }
        assert_eq!(many[3], (0, 100), "the forward resolves to its target");
        Ok(())
    }

    /// A forward takes over its chunk's references; references through it count for both;
    /// it goes when its last one does, and its target lives while it does.
    #[test]
    fn a_forward_counts_for_its_target_and_goes_with_its_last_reference() -> Result<()> {
        let (mut c, mut t) = (cache()?, ChunkTable::default());
        let fp = [3u8; 16];
        t.insert(&mut c, 0, fp, &loc(1))?;
        t.insert(&mut c, 300, fp, &loc(2))?;
        t.insert(&mut c, 301, [4; 16], &loc(2))?;
        t.incref(&mut c, 0)?;
        for _ in 0..2 {
            t.incref(&mut c, 300)?;
        }
        assert_eq!(t.live().chunks, 2);
        // Only chunks with the same fingerprint, not to itself, not to a forward.
        assert!(t.forward(&mut c, 301, 0).is_err());
        assert!(t.forward(&mut c, 0, 0).is_err());
        let f = t.forward(&mut c, 300, 0)?;
        assert_eq!((f.refs, f.stored_from, f.stored_to), (2, 100, 100));
        assert_eq!(t.forwards, Some(1));
        assert!(t.forward(&mut c, 1, 300).is_err());
        assert_eq!(t.live().chunks, 1, "the forward's record is dead");
        assert_eq!(t.segment_live_bytes(2), 0);
        assert_eq!(
            t.resolve(&mut c, 300)?.map(|(id, e)| (id, e.refs)),
            Some((0, 3))
        );
        assert!(matches!(
            t.slot(&mut c, 300)?,
            Some(Slot::Forward { to: 0, refs: 2, .. })
        ));
        // Walks of records do not see it; GC may not drop it.
        let mut seen = Vec::new();
        t.for_each(&mut c, &mut |id, _| {
            seen.push(id);
            Ok(())
        })?;
        assert_eq!(seen, vec![0, 301]);
        assert!(t.remove(&mut c, 300).is_err());
        // References through it.
        assert_eq!(t.incref(&mut c, 300)?, (0, 100));
        assert_eq!(t.get(&mut c, 0)?.map(|e| e.refs), Some(4));
        for _ in 0..3 {
            assert_eq!(t.decref(&mut c, 300)?.0, 0);
        }
        assert_eq!(t.slot(&mut c, 300)?, None, "freed with its last reference");
        assert!(t.decref(&mut c, 300).is_err());
        assert_eq!(t.get(&mut c, 0)?.map(|e| e.refs), Some(1));
        t.decref(&mut c, 0)?;
        assert_eq!(t.live().chunks, 0);
        Ok(())
    }
}
