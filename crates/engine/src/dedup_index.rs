//! The dedup index: fingerprint → chunk id. Advisory (DESIGN.md invariant 3): a miss costs
//! savings, never correctness.
//!
//! It stores only chunk ids (4 bytes a slot plus hashbrown's 1 control byte); the fingerprint
//! of a candidate is read from the chunk table, so the index costs ~6–11 bytes per unique
//! chunk. Stale entries are tolerated: a lookup checks the candidate's fingerprint and that the
//! slot is still live.

use crate::chunk_table::ChunkTable;
use crate::format::Fingerprint;
use hashbrown::HashTable;

#[derive(Default)]
pub struct DedupIndex {
    table: HashTable<u32>,
}

fn hash(fp: &Fingerprint) -> u64 {
    u64::from_le_bytes([fp[0], fp[1], fp[2], fp[3], fp[4], fp[5], fp[6], fp[7]])
}

impl DedupIndex {
    /// The id of a live chunk with this fingerprint, if indexed.
    pub fn find(&self, fp: &Fingerprint, chunks: &ChunkTable) -> Option<u32> {
        self.table
            .find(hash(fp), |&id| {
                chunks
                    .get(id)
                    .is_some_and(|e| &e.fp == fp && !e.is_damaged())
            })
            .copied()
    }

    /// Index chunk `id` (whose entry in `chunks` already holds `fp`). An older entry for the
    /// same fingerprint is replaced.
    pub fn insert(&mut self, fp: &Fingerprint, id: u32, chunks: &ChunkTable) {
        self.remove(fp, chunks);
        self.table.insert_unique(hash(fp), id, |&other| {
            chunks.get(other).map(|e| hash(&e.fp)).unwrap_or(0)
        });
    }

    /// Remove the entry for `fp`, if any. Call before the chunk's slot is freed.
    pub fn remove(&mut self, fp: &Fingerprint, chunks: &ChunkTable) {
        if let Ok(entry) = self
            .table
            .find_entry(hash(fp), |&id| chunks.get(id).is_some_and(|e| &e.fp == fp))
        {
            entry.remove();
        }
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Bytes of memory the index holds.
    pub fn ram_bytes(&self) -> u64 {
        (self.table.capacity() * (std::mem::size_of::<u32>() + 1)) as u64
    }
}
