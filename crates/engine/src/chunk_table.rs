//! The chunk table: chunk id → where the chunk's record is, its fingerprint and its reference
//! count.
//!
//! Owns: the authoritative location of every chunk (with the block maps, it decides what a
//! block contains), and the per-segment live byte counts that GC reads.
//! Invariants:
//! - `refs` equals the number of block-map entries naming the chunk; it is never persisted but
//!   recomputed from the maps when a pool opens.
//! - A slot is live (has a location), free (its id may be handed out again) or damaged (its
//!   checkpoint section failed its checksum: reads of it fail, it is never reused).
//! - Entries live in fixed pages of 4096, so memory grows by 128 KiB steps, not by doubling.

use crate::format::{ChunkCodec, Fingerprint, Location, CHUNK_ID_LIMIT};
use std::collections::HashMap;

const PAGE: usize = 4096;
const FREE: u32 = u32::MAX;
const DAMAGED: u32 = u32::MAX - 1;

/// One slot, packed to 32 bytes.
#[derive(Clone, Copy, Debug)]
pub struct ChunkEntry {
    pub fp: Fingerprint,
    segment: u32,
    offset: u32,
    len_codec: u32,
    pub refs: u32,
}
const _: () = assert!(std::mem::size_of::<ChunkEntry>() == 32);

impl ChunkEntry {
    const EMPTY: ChunkEntry = ChunkEntry {
        fp: [0; 16],
        segment: FREE,
        offset: 0,
        len_codec: 0,
        refs: 0,
    };

    pub fn location(&self) -> Option<Location> {
        if self.segment >= DAMAGED {
            return None;
        }
        Some(Location {
            segment: self.segment,
            offset: self.offset,
            stored_len: self.len_codec & 0x00ff_ffff,
            codec: ChunkCodec::from_u8((self.len_codec >> 24) as u8).unwrap_or(ChunkCodec::Raw),
        })
    }

    pub fn is_damaged(&self) -> bool {
        self.segment == DAMAGED
    }

    fn set_location(&mut self, loc: &Location) {
        self.segment = loc.segment;
        self.offset = loc.offset;
        self.len_codec = loc.stored_len | (loc.codec as u32) << 24;
    }
}

#[derive(Default)]
pub struct ChunkTable {
    pages: Vec<Box<[ChunkEntry]>>,
    len: u32,
    free: Vec<u32>,
    /// Bytes of records of chunks with refs > 0, per segment.
    live_bytes: HashMap<u32, u64>,
    live_chunks: u64,
    live_stored_bytes: u64,
}

impl ChunkTable {
    /// Number of slots (the highest id handed out + 1).
    pub fn len(&self) -> u32 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn get(&self, id: u32) -> Option<&ChunkEntry> {
        if id >= self.len {
            return None;
        }
        let e = &self.pages[id as usize / PAGE][id as usize % PAGE];
        (e.segment != FREE).then_some(e)
    }

    fn slot_mut(&mut self, id: u32) -> &mut ChunkEntry {
        while id >= self.len {
            if (self.len as usize).is_multiple_of(PAGE)
                && self.pages.len() <= self.len as usize / PAGE
            {
                self.pages
                    .push(vec![ChunkEntry::EMPTY; PAGE].into_boxed_slice());
            }
            self.len += 1;
        }
        &mut self.pages[id as usize / PAGE][id as usize % PAGE]
    }

    /// The next free id, or None when all ids are taken.
    pub fn allocate_id(&mut self) -> Option<u32> {
        if let Some(id) = self.free.pop() {
            return Some(id);
        }
        if self.len >= CHUNK_ID_LIMIT {
            return None;
        }
        let id = self.len;
        self.slot_mut(id);
        Some(id)
    }

    /// Put a chunk into slot `id` (new, or loaded from a checkpoint or journal).
    pub fn insert(&mut self, id: u32, fp: Fingerprint, loc: &Location) {
        let e = self.slot_mut(id);
        let refs = e.refs;
        debug_assert!(e.segment == FREE, "chunk {id} inserted twice");
        e.fp = fp;
        e.set_location(loc);
        if refs > 0 {
            // Only during load, when maps were read before the table.
            self.account(id, true);
        }
    }

    /// Mark slot `id` as damaged (its metadata could not be read).
    pub fn mark_damaged(&mut self, id: u32) {
        let e = self.slot_mut(id);
        e.segment = DAMAGED;
    }

    /// References counted on a slot that holds no chunk (a dangling map entry while loading).
    pub fn refs_of_free(&self, id: u32) -> u32 {
        if id >= self.len {
            return 0;
        }
        let e = &self.pages[id as usize / PAGE][id as usize % PAGE];
        if e.segment == FREE {
            e.refs
        } else {
            0
        }
    }

    /// After loading: every slot that is still free goes on the free list.
    pub fn rebuild_free_list(&mut self) {
        self.free = (0..self.len)
            .rev()
            .filter(|&id| {
                let e = &self.pages[id as usize / PAGE][id as usize % PAGE];
                e.segment == FREE && e.refs == 0
            })
            .collect();
    }

    pub fn relocate(&mut self, id: u32, loc: &Location) {
        let live = self.get(id).is_some_and(|e| e.refs > 0);
        if live {
            self.account(id, false);
        }
        self.slot_mut(id).set_location(loc);
        if live {
            self.account(id, true);
        }
    }

    /// Forget chunk `id` (it has no references) and make its id reusable.
    pub fn remove(&mut self, id: u32) {
        let e = self.slot_mut(id);
        debug_assert_eq!(e.refs, 0, "chunk {id} removed while referenced");
        *e = ChunkEntry::EMPTY;
        self.free.push(id);
    }

    fn account(&mut self, id: u32, add: bool) {
        let Some(loc) = self.get(id).and_then(|e| e.location()) else {
            return;
        };
        let bytes = loc.record_bytes();
        let seg = self.live_bytes.entry(loc.segment).or_insert(0);
        if add {
            *seg += bytes;
            self.live_chunks += 1;
            self.live_stored_bytes += u64::from(loc.stored_len);
        } else {
            *seg -= bytes;
            self.live_chunks -= 1;
            self.live_stored_bytes -= u64::from(loc.stored_len);
        }
    }

    /// Take a reference. Works on a free slot too (while loading maps before the table).
    pub fn incref(&mut self, id: u32) {
        let e = self.slot_mut(id);
        // Saturating: a count stuck at the maximum only keeps the chunk forever, never frees
        // it early. The write path stops sharing a chunk long before (REFS_MAX).
        e.refs = e.refs.saturating_add(1);
        if e.refs == 1 {
            self.account(id, true);
        }
    }

    /// Drop a reference; returns the count left.
    pub fn decref(&mut self, id: u32) -> u32 {
        let e = self.slot_mut(id);
        debug_assert!(e.refs > 0, "chunk {id} dereferenced below zero");
        e.refs = e.refs.saturating_sub(1);
        let left = e.refs;
        if left == 0 {
            self.account(id, false);
        }
        left
    }

    /// Live bytes of records in `segment`.
    pub fn segment_live_bytes(&self, segment: u32) -> u64 {
        self.live_bytes.get(&segment).copied().unwrap_or(0)
    }

    /// Chunks with at least one reference.
    pub fn live_chunks(&self) -> u64 {
        self.live_chunks
    }

    /// Payload bytes (after compression) of live chunks.
    pub fn live_stored_bytes(&self) -> u64 {
        self.live_stored_bytes
    }

    /// Every occupied slot: (id, entry).
    pub fn iter(&self) -> impl Iterator<Item = (u32, &ChunkEntry)> {
        (0..self.len).filter_map(|id| {
            let e = &self.pages[id as usize / PAGE][id as usize % PAGE];
            (e.segment != FREE).then_some((id, e))
        })
    }

    /// Bytes of memory the table holds.
    pub fn ram_bytes(&self) -> u64 {
        (self.pages.len() * PAGE * std::mem::size_of::<ChunkEntry>() + self.free.capacity() * 4)
            as u64
    }
}
