//! What repair asks of the pool core: the salvage replay's hook (what a replay past journal
//! damage sets aside for the rebuild), the metadata and segments of a salvage open, and where
//! a metadata page is stored.
//!
//! Owns: [`apply_after_damage`] and its [`SalvageHook`]. [`crate::repair`] builds the new
//! metadata from what these hand it; nothing here writes.

use crate::crypto::Crypto;
use crate::error::Result;
use crate::format::{Fingerprint, JournalRecord, Location};
use crate::journal::Salvage;
use crate::metadata::{Metadata, Mode, SalvageHook};
use crate::segment::Segments;

use super::Pool;

impl Pool {
    /// Run `f` over the metadata and segments of a salvage open
    /// ([`super::OpenOptions::salvage_journal`], read-only) with the journal's next sequence
    /// number: what repair rebuilds from.
    pub(crate) fn salvaged<R>(&self, f: impl FnOnce(&mut Metadata, &Segments, u64) -> R) -> R {
        debug_assert!(
            self.read_only && self.opts.salvage_journal,
            "a salvage open"
        );
        let mut st = self.lock_state();
        let st = &mut *st;
        let next_seq = st.journal.next_seq();
        f(&mut st.md, &st.segments, next_seq)
    }

    /// Where the page of tree `tree` holding leaf `leaf` is stored: its byte offset in
    /// `meta.dat` (`None` if the page was never written).
    pub(crate) fn stored_page_offset(&self, tree: u64, leaf: u64) -> Result<Option<u64>> {
        let mut st = self.lock_state();
        let pages = st.md.pages.leaf_pages(tree, leaf, leaf + 1)?;
        Ok(pages
            .first()
            .filter(|p| p.page != 0)
            .map(|p| p.page * crate::page_cache::UNIT as u64))
    }
}

/// Apply one journal batch in salvage mode ([`Mode::Salvage`]: what it tolerates and sets
/// aside). Chunk locations are kept in `s` if their data is on disk; with `after_damage`,
/// the blocks the batch wrote are remembered as written after the damage.
pub(crate) fn apply_after_damage(
    md: &mut Metadata,
    segments: &Segments,
    crypto: Option<&Crypto>,
    records: Vec<JournalRecord>,
    after_damage: bool,
    s: &mut Salvage,
) -> Result<()> {
    let mut hook = AfterDamage {
        segments,
        crypto,
        block_size: md.block_size,
        after_damage,
        salvage: s,
    };
    for r in &records {
        md.apply_in(r, &mut Mode::Salvage(&mut hook))?;
    }
    md.pages.evict_to_budget()
}

/// What a salvage replay keeps for the rebuild: [`Salvage`], filled batch by batch.
struct AfterDamage<'a> {
    segments: &'a Segments,
    crypto: Option<&'a Crypto>,
    block_size: u32,
    /// The batch comes after a damaged stretch.
    after_damage: bool,
    salvage: &'a mut Salvage,
}

impl SalvageHook for AfterDamage<'_> {
    fn chunk_placed(&mut self, id: u64, loc: &Location, fp: Option<&Fingerprint>) {
        let record = match fp {
            Some(fp) => JournalRecord::NewChunk {
                id,
                loc: *loc,
                fp: *fp,
            },
            None => JournalRecord::Relocate { id, loc: *loc },
        };
        if self
            .segments
            .batch_data_present(&[record], self.block_size, self.crypto)
        {
            // A move keeps the fingerprint an earlier batch gave.
            let fp = fp
                .copied()
                .or_else(|| self.salvage.chunks.get(&id).and_then(|c| c.1));
            self.salvage.chunks.insert(id, (*loc, fp));
        }
    }

    /// Ignored: the chunk keeps its own record in the rebuild. That record is still on disk:
    /// GC deletes a segment only after a checkpoint, and this forward came after the last.
    fn chunk_forwarded(&mut self, _id: u64, _to: u64) {}

    fn blocks_written(&mut self, vol: u32, start: u64, end: u64) {
        if self.after_damage {
            self.salvage
                .written_after
                .entry(vol)
                .or_default()
                .push((start, end));
        }
    }

    fn skip(&mut self, what: String) {
        self.salvage.skipped.push(what);
    }
}
