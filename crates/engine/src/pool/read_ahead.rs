//! Read-ahead through a volume's block map, for stores whose reads cost requests (a bucket).
//!
//! A sequential reader of a volume reads its blocks in order, but their records are in order
//! in their segments only where the data was new when written: a block deduplicated against
//! older data points anywhere in an older segment, and a read of it was one request the
//! reader waited for. So when a read continues the volume's previous one, the blocks ahead
//! of it ([`WINDOW_BYTES`]) are looked up in the map, and the records the cache tier does not
//! hold are hinted to their files ([`crate::io::File::will_need`]), which fetch them in the
//! background.
//!
//! Owns: per volume, where its last read ended and how far ahead it was hinted.
//!
//! Invariants:
//! - Only a hint: nothing here fails a read or changes what it returns; a block-map lookup
//!   that fails here fails again, with its error, when the reader gets there.
//! - Each block is looked up ahead at most once per sequential run, in steps of
//!   [`STEP_BYTES`], so a reader pays one extra map lookup per block at most.

use super::Pool;
use crate::format::{ENTRY_LOST, ENTRY_UNMAPPED, ENTRY_ZERO};
use crate::locks::lock;
use std::collections::HashMap;
use std::sync::Mutex;

/// How far ahead of a sequential reader the block map is looked up.
const WINDOW_BYTES: u64 = 16 << 20;
/// The window is topped up once the reader is this close to its end.
const STEP_BYTES: u64 = 4 << 20;
/// A gap between two records of one file up to which one hint covers both (the bucket reads
/// 256 KiB blocks anyway).
const MERGE_GAP_BYTES: u64 = 256 << 10;

/// Per volume: the block after its last read, and the block it was hinted up to.
#[derive(Default)]
pub(crate) struct ReadAhead {
    streams: Mutex<HashMap<u32, (u64, u64)>>,
}

impl ReadAhead {
    /// After a read of `count` blocks from `first` of volume `vol`: the blocks to look up
    /// ahead, if the read continues the volume's previous one (from where it ended, or
    /// further on within the window already hinted or [`STEP_BYTES`] past its end) and the
    /// hinted window runs out within [`STEP_BYTES`].
    pub(crate) fn next_window(
        &self,
        vol: u32,
        first: u64,
        count: u64,
        block_size: u32,
    ) -> Option<(u64, u64)> {
        let (window, step) = (
            WINDOW_BYTES / u64::from(block_size),
            STEP_BYTES / u64::from(block_size),
        );
        let end = first.saturating_add(count);
        let mut streams = lock(&self.streams);
        let (next, hinted_to) = streams.entry(vol).or_insert((u64::MAX, 0));
        // A reader that skips ahead within the window read ahead (or a step past its last
        // read) still reads in order: `export` and `nbdcopy` skip holes.
        let sequential = *next <= first && first <= (*hinted_to).max(*next).saturating_add(step);
        *next = end;
        if !sequential {
            *hinted_to = end;
            return None;
        }
        let from = (*hinted_to).max(end);
        if from >= end.saturating_add(window - step) {
            return None;
        }
        let to = end.saturating_add(window);
        *hinted_to = to;
        Some((from, to))
    }
}

impl Pool {
    /// Hint the records of blocks `from..to` of volume `vol` that the cache tier does not
    /// hold to their files, merged into ranges per file.
    pub(super) fn hint_blocks(&self, vol: u32, from: u64, to: u64) {
        let tier = self.tier();
        let mut ranges = Vec::new();
        let hints: Vec<(std::sync::Arc<dyn crate::io::File>, u64, u64)> = {
            let mut st = self.lock_state();
            let Some(v) = st.md.volumes.get(&vol) else {
                return;
            };
            let to = to.min(v.size / u64::from(self.sb.block_size));
            if from >= to {
                return;
            }
            let mut entries = Vec::with_capacity((to - from) as usize);
            let md = &mut st.md;
            if crate::block_map::get_range(
                &mut md.pages,
                u64::from(vol),
                from,
                to - from,
                &mut entries,
            )
            .is_err()
            {
                return;
            }
            for e in entries {
                if e == ENTRY_ZERO || e == ENTRY_UNMAPPED || e == ENTRY_LOST {
                    continue;
                }
                let Ok(Some((id, c))) = md.chunks.resolve(&mut md.pages, e) else {
                    continue;
                };
                if tier.as_ref().is_some_and(|t| t.holds(id, &c.fp)) {
                    continue;
                }
                ranges.push((c.loc.segment, u64::from(c.loc.offset), c.loc.record_bytes()));
            }
            if let Err(e) = md.pages.evict_to_budget() {
                // As a read's own lookup does: the pool cannot go on from a failed eviction.
                st.poisoned = Some(e.to_string());
                return;
            }
            ranges.sort_unstable();
            ranges.dedup();
            let mut merged: Vec<(u32, u64, u64)> = Vec::new();
            for (seg, off, len) in ranges {
                match merged.last_mut() {
                    Some((s, o, l)) if *s == seg && off <= *o + *l + MERGE_GAP_BYTES => {
                        *l = (*l).max(off + len - *o);
                    }
                    _ => merged.push((seg, off, len)),
                }
            }
            merged
                .into_iter()
                .filter_map(|(seg, off, len)| Some((st.segments.file(seg)?, off, len)))
                .collect()
        };
        for (file, off, len) in hints {
            file.will_need(off, len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_reader_that_continues_its_last_read_is_read_ahead_once_per_step() {
        let ra = ReadAhead::default();
        let bs = 4096;
        let (window, step) = (WINDOW_BYTES / 4096, STEP_BYTES / 4096);
        // A first read is not known to be sequential.
        assert_eq!(ra.next_window(1, 0, 256, bs), None);
        // It continues: the window after it.
        assert_eq!(ra.next_window(1, 256, 256, bs), Some((512, 512 + window)));
        // The next reads are within the window until it runs out within a step: then the
        // window is topped up from where it ended.
        let (mut end, mut got) = (512, None);
        while got.is_none() {
            got = ra.next_window(1, end, 256, bs);
            end += 256;
        }
        assert_eq!(
            end,
            512 + step + 256,
            "topped up once the reader is past a step"
        );
        assert_eq!(got, Some((512 + window, end + window)));
        let at = end;
        // Another volume's reads are their own stream; a jump back or far ahead starts over.
        assert_eq!(ra.next_window(2, at + 256, 256, bs), None);
        assert_eq!(ra.next_window(1, 0, 256, bs), None);
        assert_eq!(ra.next_window(1, 256, 256, bs), Some((512, 512 + window)));
        assert_eq!(ra.next_window(1, 512 + window + step + 1, 256, bs), None);
        // A hole skipped within a step still reads in order.
        let after = 512 + window + step + 1 + 256;
        assert_eq!(
            ra.next_window(1, after + step, 256, bs),
            Some((after + step + 256, after + step + 256 + window))
        );
    }
}
