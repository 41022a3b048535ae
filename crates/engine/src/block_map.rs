//! A volume's block map: block number → chunk id, or ZERO / UNMAPPED.
//!
//! Owns: the authoritative content of each block of one volume (with the chunk table).
//! Stored as pages of 1024 four-byte entries, allocated on first write, so a thin volume costs
//! memory only where it was written. A page that becomes all UNMAPPED is freed.

use crate::format::{ENTRY_UNMAPPED, ENTRY_ZERO, MAP_PAGE_ENTRIES};
use std::collections::BTreeMap;

#[derive(Default)]
pub struct BlockMap {
    pages: BTreeMap<u64, Box<[u32]>>,
    data_blocks: u64,
    zero_blocks: u64,
}

impl BlockMap {
    pub fn get(&self, block: u64) -> u32 {
        let (p, i) = split(block);
        self.pages.get(&p).map_or(ENTRY_UNMAPPED, |page| page[i])
    }

    /// Set one entry; returns the old one.
    pub fn set(&mut self, block: u64, entry: u32) -> u32 {
        let (p, i) = split(block);
        let old = match self.pages.get_mut(&p) {
            Some(page) => std::mem::replace(&mut page[i], entry),
            None if entry == ENTRY_UNMAPPED => return ENTRY_UNMAPPED,
            None => {
                let mut page = vec![ENTRY_UNMAPPED; MAP_PAGE_ENTRIES].into_boxed_slice();
                page[i] = entry;
                self.pages.insert(p, page);
                ENTRY_UNMAPPED
            }
        };
        self.count(old, false);
        self.count(entry, true);
        if entry == ENTRY_UNMAPPED && old != ENTRY_UNMAPPED {
            if let Some(page) = self.pages.get(&p) {
                if page.iter().all(|&e| e == ENTRY_UNMAPPED) {
                    self.pages.remove(&p);
                }
            }
        }
        old
    }

    fn count(&mut self, entry: u32, add: bool) {
        let c = match entry {
            ENTRY_UNMAPPED => return,
            ENTRY_ZERO => &mut self.zero_blocks,
            _ => &mut self.data_blocks,
        };
        if add {
            *c += 1
        } else {
            *c -= 1
        }
    }

    /// Load a page from a checkpoint.
    pub fn load_page(&mut self, page_no: u64, entries: &[u32]) {
        for &e in entries {
            self.count(e, true);
        }
        self.pages
            .insert(page_no, entries.to_vec().into_boxed_slice());
    }

    /// Every mapped entry at or after `from`: (block, entry).
    pub fn iter_from(&self, from: u64) -> impl Iterator<Item = (u64, u32)> + '_ {
        let (p0, _) = split(from);
        self.pages.range(p0..).flat_map(move |(&p, page)| {
            page.iter().enumerate().filter_map(move |(i, &e)| {
                let block = p * MAP_PAGE_ENTRIES as u64 + i as u64;
                (e != ENTRY_UNMAPPED && block >= from).then_some((block, e))
            })
        })
    }

    pub fn pages(&self) -> impl Iterator<Item = (u64, &[u32])> {
        self.pages.iter().map(|(&p, page)| (p, &page[..]))
    }

    /// Blocks holding a chunk.
    pub fn data_blocks(&self) -> u64 {
        self.data_blocks
    }

    /// Blocks written as zeros.
    pub fn zero_blocks(&self) -> u64 {
        self.zero_blocks
    }

    pub fn ram_bytes(&self) -> u64 {
        // Page payload plus a BTreeMap node share (~48 bytes) per page.
        self.pages.len() as u64 * (MAP_PAGE_ENTRIES as u64 * 4 + 48)
    }
}

fn split(block: u64) -> (u64, usize) {
    (
        block / MAP_PAGE_ENTRIES as u64,
        (block % MAP_PAGE_ENTRIES as u64) as usize,
    )
}
