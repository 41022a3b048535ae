//! Chunk-table slots: the 32-byte records of a chunk-table leaf, 128 to a page:
//! fingerprint (16), segment (4), offset (4), length and codec (4), references (4); a record
//! whose length/codec word is 0 is free. docs/FORMAT.md "Metadata pages".
//!
//! A slot may instead be a **forward** (length/codec word [`FORWARD_WORD`]): the chunk was
//! found to be a duplicate of chunk `to` by the merge pass, and every block naming it reads
//! `to`'s record. Its segment and offset words hold `to` (low and high 32 bits), its
//! references word the number of block-map entries naming it (also counted in `to`'s).
//!
//! Invariants: decoding never panics (a slot past the page is `None`; an unknown codec reads
//! as raw, and the record's own check then fails the read); encoding a free slot writes
//! zeros; [`decode_slot`] gives only slots with a record of their own (a forward reads as
//! `None` there: every walk of records skips it), [`decode_any`] gives forwards too.

use super::common::{ChunkCodec, Fingerprint, Location, CHUNKS_PER_PAGE};

/// Bytes of one slot.
pub const REC: usize = 32;

/// One chunk's record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkEntry {
    pub fp: Fingerprint,
    pub loc: Location,
    pub refs: u32,
}

impl ChunkEntry {
    pub fn location(&self) -> Option<Location> {
        Some(self.loc)
    }
}

/// The length/codec word of a forward slot (codec byte 0xff, which no record uses).
pub const FORWARD_WORD: u32 = 0xff00_0000;

/// A slot in use: a chunk with a record of its own, or a forward to another chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    Chunk(ChunkEntry),
    /// Blocks naming this chunk read chunk `to` (same fingerprint); `refs` of them name it.
    Forward {
        fp: Fingerprint,
        to: u64,
        refs: u32,
    },
}

impl Slot {
    pub fn fp(&self) -> &Fingerprint {
        match self {
            Slot::Chunk(e) => &e.fp,
            Slot::Forward { fp, .. } => fp,
        }
    }
}

/// Decode slot `i` of a chunk-table page, forwards included; `None` if free (or past the
/// end of `page`).
pub fn decode_any(page: &[u8], i: usize) -> Option<Slot> {
    let r = page.get(i * REC..(i + 1) * REC)?;
    let word = |at: usize| u32::from_le_bytes([r[at], r[at + 1], r[at + 2], r[at + 3]]);
    if word(24) != FORWARD_WORD {
        return decode_slot(page, i).map(Slot::Chunk);
    }
    let mut fp = [0u8; 16];
    fp.copy_from_slice(&r[..16]);
    Some(Slot::Forward {
        fp,
        to: u64::from(word(16)) | u64::from(word(20)) << 32,
        refs: word(28),
    })
}

/// Encode a forward into slot `i`.
pub fn encode_forward(page: &mut [u8], i: usize, fp: &Fingerprint, to: u64, refs: u32) {
    let r = &mut page[i * REC..(i + 1) * REC];
    r[..16].copy_from_slice(fp);
    r[16..20].copy_from_slice(&(to as u32).to_le_bytes());
    r[20..24].copy_from_slice(&((to >> 32) as u32).to_le_bytes());
    r[24..28].copy_from_slice(&FORWARD_WORD.to_le_bytes());
    r[28..32].copy_from_slice(&refs.to_le_bytes());
}

/// Decode record `i` of a chunk-table page, `None` if free, a forward (see [`decode_any`])
/// or past the end of `page`.
pub fn decode_slot(page: &[u8], i: usize) -> Option<ChunkEntry> {
    let r = page.get(i * REC..(i + 1) * REC)?;
    let word = |at: usize| u32::from_le_bytes([r[at], r[at + 1], r[at + 2], r[at + 3]]);
    let len_codec = word(24);
    if len_codec == 0 || len_codec == FORWARD_WORD {
        return None;
    }
    let mut fp = [0u8; 16];
    fp.copy_from_slice(&r[..16]);
    Some(ChunkEntry {
        fp,
        loc: Location {
            segment: word(16),
            offset: word(20),
            stored_len: len_codec & 0x00ff_ffff,
            codec: ChunkCodec::from_u8((len_codec >> 24) as u8).unwrap_or(ChunkCodec::Raw),
        },
        refs: word(28),
    })
}

/// The live records of a chunk-table page whose fingerprint is `fp`, with their slots
/// (fingerprints are compared in place; only matches are decoded).
pub fn slots_with_fp<'a>(
    page: &'a [u8],
    fp: &'a Fingerprint,
) -> impl Iterator<Item = (usize, ChunkEntry)> + 'a {
    (0..CHUNKS_PER_PAGE)
        .filter(move |&i| page[i * REC..i * REC + 16] == fp[..])
        .filter_map(move |i| decode_slot(page, i).map(|e| (i, e)))
}

pub fn encode_slot(page: &mut [u8], i: usize, e: Option<&ChunkEntry>) {
    let r = &mut page[i * REC..(i + 1) * REC];
    match e {
        None => r.fill(0),
        Some(e) => {
            r[..16].copy_from_slice(&e.fp);
            r[16..20].copy_from_slice(&e.loc.segment.to_le_bytes());
            r[20..24].copy_from_slice(&e.loc.offset.to_le_bytes());
            let lc = e.loc.stored_len | (e.loc.codec as u32) << 24;
            r[24..28].copy_from_slice(&lc.to_le_bytes());
            r[28..32].copy_from_slice(&e.refs.to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(i: u32) -> ChunkEntry {
        ChunkEntry {
            fp: [i as u8 + 1; 16],
            loc: Location {
                segment: 7 + i,
                offset: 4096 * i,
                stored_len: 100 + i,
                codec: ChunkCodec::Zstd,
            },
            refs: 3 * i + 1,
        }
    }

    #[test]
    fn slots_round_trip() {
        let mut page = vec![0u8; CHUNKS_PER_PAGE * REC];
        for i in [0, 5, CHUNKS_PER_PAGE - 1] {
            encode_slot(&mut page, i, Some(&entry(i as u32)));
        }
        for i in [0, 5, CHUNKS_PER_PAGE - 1] {
            assert_eq!(decode_slot(&page, i), Some(entry(i as u32)));
        }
        assert_eq!(decode_slot(&page, 1), None, "a zero slot is free");
        let fp = entry(5).fp;
        let found: Vec<_> = slots_with_fp(&page, &fp).collect();
        assert_eq!(found, vec![(5, entry(5))]);
        encode_slot(&mut page, 5, None);
        assert_eq!(decode_slot(&page, 5), None);
    }

    #[test]
    fn forwards_round_trip_and_are_no_record() {
        let mut page = vec![0u8; CHUNKS_PER_PAGE * REC];
        encode_slot(&mut page, 4, Some(&entry(4)));
        let to = (1u64 << 47) + 12345;
        encode_forward(&mut page, 4, &[9; 16], to, 17);
        assert_eq!(decode_slot(&page, 4), None, "a forward has no record");
        assert_eq!(
            decode_any(&page, 4),
            Some(Slot::Forward {
                fp: [9; 16],
                to,
                refs: 17
            })
        );
        assert_eq!(slots_with_fp(&page, &[9; 16]).count(), 0);
        encode_slot(&mut page, 5, Some(&entry(5)));
        assert_eq!(decode_any(&page, 5), Some(Slot::Chunk(entry(5))));
        assert_eq!(decode_any(&page, 6), None);
    }

    #[test]
    fn damaged_or_truncated_slots_do_not_panic() {
        let mut page = vec![0u8; CHUNKS_PER_PAGE * REC];
        encode_slot(&mut page, 2, Some(&entry(2)));
        assert_eq!(decode_slot(&page[..REC * 2 + 10], 2), None, "truncated");
        assert_eq!(decode_slot(&page, CHUNKS_PER_PAGE), None, "past the page");
        page[2 * REC + 27] = 0xee; // an unknown codec
        let e = decode_slot(&page, 2).map(|e| e.loc.codec);
        assert_eq!(e, Some(ChunkCodec::Raw));
    }
}
