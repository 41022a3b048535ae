//! `dedup.idx`: the dedup index saved at a clean close, so the next open loads it instead of
//! reading the whole chunk table again. docs/FORMAT.md "Saved dedup index".
//!
//! Layout: a 128-byte header, then for each of the index's shards in order its capacity and
//! length (two `u32`) and its slots (capacity × 6 bytes: three `u16`). The header names the
//! checkpoint root the index was saved at ([`IndexStamp`]); an open uses the file only when
//! its root is that one and no chunk was added or removed since.
//!
//! Invariants: decoding never panics and never allocates more than the file holds; the
//! header and the body each carry a CRC-32C. The index is advisory (a lookup is confirmed
//! against the chunk table), so a file that fails any check is ignored, never an error of
//! the pool.

use super::common::{check_magic, crc, put_u32, put_u64, Reader};
use crate::error::{Error, Result};

pub const DEDUP_INDEX_NAME: &str = "dedup.idx";
pub const DEDUP_INDEX_MAGIC: [u8; 8] = *b"CNDSDIDX";
pub const DEDUP_INDEX_VERSION: u32 = 1;
pub const DEDUP_INDEX_HEADER_BYTES: usize = 128;
/// Bytes of a shard's head (capacity, length).
pub const SHARD_HEAD_BYTES: usize = 8;
/// Bytes of one slot.
pub const SLOT_BYTES: usize = 6;
/// Where the header holds the body's CRC.
pub const BODY_CRC_AT: usize = 92;

/// The checkpoint root an index was saved at: every field changes when the chunk table does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStamp {
    pub journal_gen: u64,
    pub next_seq: u64,
    pub checkpoints: u64,
    pub next_chunk: u64,
    pub live_chunks: u64,
    /// The chunk table's root page and its CRC (copy-on-write: a new page at every change).
    pub chunk_tree_page: u64,
    pub chunk_tree_crc: u32,
}

/// The header of `dedup.idx`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DedupIndexHeader {
    pub uuid: [u8; 16],
    pub stamp: IndexStamp,
    pub shards: u32,
    /// Entries of all shards together.
    pub entries: u64,
    /// CRC-32C of every byte after the header.
    pub body_crc: u32,
}

const WHAT: &str = "saved dedup index (dedup.idx)";

pub fn encode_dedup_index_header(h: &DedupIndexHeader) -> Vec<u8> {
    let mut out = Vec::with_capacity(DEDUP_INDEX_HEADER_BYTES);
    out.extend_from_slice(&DEDUP_INDEX_MAGIC);
    put_u32(&mut out, DEDUP_INDEX_VERSION);
    put_u32(&mut out, h.shards);
    out.extend_from_slice(&h.uuid);
    let s = &h.stamp;
    for v in [
        s.journal_gen,
        s.next_seq,
        s.checkpoints,
        s.next_chunk,
        s.live_chunks,
        s.chunk_tree_page,
    ] {
        put_u64(&mut out, v);
    }
    put_u32(&mut out, s.chunk_tree_crc);
    put_u64(&mut out, h.entries);
    debug_assert_eq!(out.len(), BODY_CRC_AT);
    put_u32(&mut out, h.body_crc);
    out.resize(DEDUP_INDEX_HEADER_BYTES - 4, 0);
    let c = crc(&[&out]);
    put_u32(&mut out, c);
    out
}

pub fn decode_dedup_index_header(bytes: &[u8]) -> Result<DedupIndexHeader> {
    let mut r = Reader::new(bytes, WHAT);
    let all = r.bytes(DEDUP_INDEX_HEADER_BYTES)?;
    let (body, tail) = all.split_at(DEDUP_INDEX_HEADER_BYTES - 4);
    let stored = u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
    let found = crc(&[body]);
    if stored != found {
        return Err(Error::Checksum {
            what: WHAT.into(),
            expected: stored,
            found,
        });
    }
    let mut r = Reader::new(body, WHAT);
    check_magic(r.bytes(8)?, &DEDUP_INDEX_MAGIC, WHAT)?;
    let version = r.u32()?;
    if version != DEDUP_INDEX_VERSION {
        return Err(Error::corrupt(WHAT, format!("unknown version {version}")));
    }
    let shards = r.u32()?;
    let uuid = r.array::<16>()?;
    let stamp = IndexStamp {
        journal_gen: r.u64()?,
        next_seq: r.u64()?,
        checkpoints: r.u64()?,
        next_chunk: r.u64()?,
        live_chunks: r.u64()?,
        chunk_tree_page: r.u64()?,
        chunk_tree_crc: r.u32()?,
    };
    Ok(DedupIndexHeader {
        uuid,
        stamp,
        shards,
        entries: r.u64()?,
        body_crc: r.u32()?,
    })
}

pub fn encode_shard_head(cap: u32, len: u32) -> [u8; SHARD_HEAD_BYTES] {
    let mut out = [0u8; SHARD_HEAD_BYTES];
    out[..4].copy_from_slice(&cap.to_le_bytes());
    out[4..].copy_from_slice(&len.to_le_bytes());
    out
}

/// A shard's (capacity, length).
pub fn decode_shard_head(bytes: &[u8; SHARD_HEAD_BYTES]) -> (u32, u32) {
    let cap = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    let len = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    (cap, len)
}

/// Append `slots` to `out`, 6 bytes each.
pub fn encode_slots(slots: &[[u16; 3]], out: &mut Vec<u8>) {
    out.reserve(slots.len() * SLOT_BYTES);
    for s in slots {
        for v in s {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
}

/// The slots in `bytes` (a whole number of them; a partial one at the end is ignored).
pub fn decode_slots(bytes: &[u8], out: &mut Vec<[u16; 3]>) {
    out.extend(bytes.chunks_exact(SLOT_BYTES).map(|b| {
        [
            u16::from_le_bytes([b[0], b[1]]),
            u16::from_le_bytes([b[2], b[3]]),
            u16::from_le_bytes([b[4], b[5]]),
        ]
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> DedupIndexHeader {
        DedupIndexHeader {
            uuid: [9; 16],
            stamp: IndexStamp {
                journal_gen: 7,
                next_seq: 1234,
                checkpoints: 99,
                next_chunk: 5000,
                live_chunks: 4321,
                chunk_tree_page: 77,
                chunk_tree_crc: 0xdead_beef,
            },
            shards: 4096,
            entries: 4321,
            body_crc: 0x1234_5678,
        }
    }

    #[test]
    fn header_round_trips() -> Result<()> {
        let bytes = encode_dedup_index_header(&header());
        assert_eq!(bytes.len(), DEDUP_INDEX_HEADER_BYTES);
        assert_eq!(decode_dedup_index_header(&bytes)?, header());
        Ok(())
    }

    #[test]
    fn a_damaged_or_truncated_header_is_an_error() {
        let bytes = encode_dedup_index_header(&header());
        for at in [0, 8, 20, 40, 100, DEDUP_INDEX_HEADER_BYTES - 1] {
            let mut bad = bytes.clone();
            bad[at] ^= 0x40;
            assert!(decode_dedup_index_header(&bad).is_err(), "flip at {at}");
        }
        assert!(decode_dedup_index_header(&bytes[..DEDUP_INDEX_HEADER_BYTES - 1]).is_err());
        assert!(decode_dedup_index_header(&[]).is_err());
    }

    #[test]
    fn slots_and_shard_heads_round_trip() {
        let slots = vec![[1, 2, 3], [0, 0, 0], [0xffff, 0x8000, 0x1234]];
        let mut bytes = Vec::new();
        encode_slots(&slots, &mut bytes);
        assert_eq!(bytes.len(), slots.len() * SLOT_BYTES);
        let mut back = Vec::new();
        // A partial slot at the end is not one.
        bytes.push(7);
        decode_slots(&bytes, &mut back);
        assert_eq!(back, slots);
        assert_eq!(decode_shard_head(&encode_shard_head(70, 63)), (70, 63));
    }
}
