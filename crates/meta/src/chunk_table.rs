//! The chunk table: chunk id → where the chunk's record is, its fingerprint and its reference
//! count.
//!
//! Owns: the authoritative location of every chunk (with the block maps, it decides what a
//! block contains), the reference counts, and the per-segment live byte counts that GC reads.
//! Stored as a paged copy-on-write tree ([`crate::page_cache`], tree [`CHUNK_TREE`]) of
//! 32-byte records, 128 to a page: fingerprint (16), segment (4), offset (4), length and codec
//! (4), references (4). A record whose length/codec word is 0 is free.
//! Invariants:
//! - `refs` equals the number of block-map entries naming the chunk; changes to it are made
//!   only by applying journal records, so replay reproduces them.
//! - Ids are handed out in increasing order and never reused (48 bits last forever), so the
//!   table is ordered by time of writing: chunks written together share pages.
//! - The counters (`live_chunks`, `live_stored_bytes`, live bytes per segment) change with
//!   every reference taken or dropped and are saved in the checkpoint root.

use crate::page_cache::{PageCache, CHUNK_TREE};
pub use condense_format::chunk_slot::encode_slot;
pub use condense_format::chunk_slot::{decode_slot, slots_with_fp, ChunkEntry};
use condense_format::error::{Error, Result};
use condense_format::{Fingerprint, Location, CHUNKS_PER_PAGE, CHUNK_ID_LIMIT};
use std::collections::HashMap;

const PER: u64 = CHUNKS_PER_PAGE as u64;

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

    pub fn get(&self, cache: &mut PageCache, id: u64) -> Result<Option<ChunkEntry>> {
        if id >= self.next_id {
            return Ok(None);
        }
        Ok(cache
            .leaf(CHUNK_TREE, page_of(id))?
            .and_then(|p| decode_slot(p, (id % PER) as usize)))
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
        self.update(cache, id, |old| match old {
            Some(e) if e.refs > 0 => Err(Error::corrupt(
                "journal",
                format!("chunk {id} dropped while {} blocks refer to it", e.refs),
            )),
            _ => Ok(None),
        })
        .map(drop)
    }

    /// Take a reference; returns the chunk's payload length.
    pub fn incref(&mut self, cache: &mut PageCache, id: u64) -> Result<u32> {
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
        Ok(new.map_or(0, |n| n.loc.stored_len))
    }

    /// Drop a reference; returns the chunk's payload length.
    pub fn decref(&mut self, cache: &mut PageCache, id: u64) -> Result<u32> {
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
        Ok(new.map_or(0, |n| n.loc.stored_len))
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
