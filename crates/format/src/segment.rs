//! Segment files (`seg-N.dat`): the 64-byte header, then chunk records (a 32-byte header and
//! the payload) packed back to back; docs/FORMAT.md "Segment file".
//!
//! Invariants: a record is trusted only if its CRC, chunk id and length/codec word match
//! what the chunk table says; in an encrypted pool its payload is authenticated (bound to
//! its fingerprint and codec) before it is decompressed.

use super::common::{
    check_crc, check_magic, check_version, crc, put_u32, ChunkCodec, Fingerprint, Location, Reader,
    FORMAT_VERSION, RECORD_HEADER_BYTES, SEGMENT_HEADER_BYTES, SEGMENT_MAGIC, SEGMENT_PREFIX,
};
use crate::crypto::{Crypto, Kind};
use crate::error::{Error, Result};

pub fn segment_name(id: u32) -> String {
    format!("{SEGMENT_PREFIX}{id:08x}.dat")
}

pub fn parse_segment_name(name: &str) -> Option<u32> {
    let hex = name.strip_prefix(SEGMENT_PREFIX)?.strip_suffix(".dat")?;
    u32::from_str_radix(hex, 16).ok()
}

/// Bits of a segment id below its member slot: the high byte of every id is the slot of the
/// host that made the segment (docs/S3.md "Many hosts"; 0 in a pool of one host), so the
/// segments of the hosts sharing one pool never share an id.
pub const SEGMENT_SLOT_SHIFT: u32 = 24;

/// The member slot of segment `id`.
pub fn segment_slot(id: u32) -> u8 {
    (id >> SEGMENT_SLOT_SHIFT) as u8
}

/// The chunk id to check a record against: `id` itself in a segment of this host (`slot`),
/// or [`ANY_RECORD_ID`] in another host's segment, whose record carries that host's chunk id
/// (it is then bound by its fingerprint instead).
pub fn record_id(id: u64, loc: &Location, slot: u8) -> u64 {
    if segment_slot(loc.segment) == slot {
        id
    } else {
        ANY_RECORD_ID
    }
}

/// Accept a record whatever chunk id it carries: [`open_record`] then requires the expected
/// fingerprint instead (a record of another host's segment).
pub const ANY_RECORD_ID: u64 = u64::MAX;

pub fn encode_segment_header(id: u32, uuid: &[u8; 16]) -> Vec<u8> {
    let mut b = Vec::with_capacity(SEGMENT_HEADER_BYTES);
    b.extend_from_slice(&SEGMENT_MAGIC);
    put_u32(&mut b, FORMAT_VERSION);
    put_u32(&mut b, id);
    b.extend_from_slice(uuid);
    b.resize(SEGMENT_HEADER_BYTES - 4, 0);
    let c = crc(&[&b]);
    put_u32(&mut b, c);
    b
}

/// Check a segment header; returns the segment id it names.
pub fn decode_segment_header(buf: &[u8], uuid: &[u8; 16]) -> Result<u32> {
    const WHAT: &str = "segment header";
    let mut r = Reader::new(buf, WHAT);
    check_magic(r.bytes(8)?, &SEGMENT_MAGIC, WHAT)?;
    check_version(r.u32()?, WHAT)?;
    let id = r.u32()?;
    let found_uuid: [u8; 16] = r.array()?;
    let body = buf
        .get(..SEGMENT_HEADER_BYTES - 4)
        .ok_or_else(|| Error::corrupt(WHAT, "short"))?;
    let mut r2 = Reader::new(&buf[SEGMENT_HEADER_BYTES - 4..], WHAT);
    check_crc(r2.u32()?, crc(&[body]), WHAT)?;
    if &found_uuid != uuid {
        return Err(Error::corrupt(WHAT, "segment belongs to another pool"));
    }
    Ok(id)
}

/// Append one chunk record (header + payload) to `out`.
pub fn encode_record(
    out: &mut Vec<u8>,
    id: u64,
    fp: &Fingerprint,
    codec: ChunkCodec,
    payload: &[u8],
) {
    let start = out.len();
    out.resize(start + RECORD_HEADER_BYTES + payload.len(), 0);
    encode_record_into(&mut out[start..], id, fp, codec, payload);
}

/// The chunk id a record's header names (its first [`RECORD_HEADER_BYTES`]), unchecked: the
/// caller confirms it some other way (0 for a shorter buffer).
pub fn record_chunk_id(head: &[u8]) -> u64 {
    let word = |at: usize| {
        head.get(at..at + 4)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map_or(0, u32::from_le_bytes)
    };
    u64::from(word(4)) | u64::from(word(28)) << 32
}

/// Make `record` (a whole record, as a segment holds it) carry chunk id `id`: a record copied
/// from another host's segment into one of this host's, whose chunk table names it by its own
/// id. The CRC is computed again; an encrypted payload is bound to its fingerprint and codec,
/// not the id, so it opens as before.
pub fn reown_record(record: &mut [u8], id: u64) {
    if record.len() < RECORD_HEADER_BYTES {
        return;
    }
    record[4..8].copy_from_slice(&(id as u32).to_le_bytes());
    record[28..32].copy_from_slice(&((id >> 32) as u32).to_le_bytes());
    let c = crc(&[&record[4..]]);
    record[..4].copy_from_slice(&c.to_le_bytes());
}

/// Write one chunk record into `out`, which is exactly `RECORD_HEADER_BYTES + payload.len()`
/// bytes long.
pub fn encode_record_into(
    out: &mut [u8],
    id: u64,
    fp: &Fingerprint,
    codec: ChunkCodec,
    payload: &[u8],
) {
    debug_assert_eq!(out.len(), RECORD_HEADER_BYTES + payload.len());
    let (head, body) = out.split_at_mut(RECORD_HEADER_BYTES);
    head[4..8].copy_from_slice(&(id as u32).to_le_bytes());
    head[8..24].copy_from_slice(fp);
    head[24..28].copy_from_slice(&(payload.len() as u32 | (codec as u32) << 24).to_le_bytes());
    head[28..32].copy_from_slice(&((id >> 32) as u32).to_le_bytes());
    body.copy_from_slice(payload);
    let c = crc(&[&head[4..], body]);
    head[..4].copy_from_slice(&c.to_le_bytes());
}

/// Check one record read from `loc` and return (fingerprint, payload).
pub fn decode_record<'a>(
    buf: &'a [u8],
    id: u64,
    loc: &Location,
) -> Result<(Fingerprint, &'a [u8])> {
    let what = || {
        format!(
            "chunk {id} in segment {} at offset {}",
            loc.segment, loc.offset
        )
    };
    let total = loc.record_bytes() as usize;
    if buf.len() < total {
        return Err(Error::corrupt(what(), "record truncated"));
    }
    let stored = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
    check_crc(stored, crc(&[&buf[4..total]]), what())?;
    let mut r = Reader::new(&buf[4..RECORD_HEADER_BYTES], "chunk record");
    let id_lo = r.u32()?;
    let fp: Fingerprint = r.array()?;
    let len_codec = r.u32()?;
    let found_id = u64::from(id_lo) | u64::from(r.u32()?) << 32;
    if (id != ANY_RECORD_ID && found_id != id) || len_codec != loc.len_codec() {
        return Err(Error::corrupt(
            what(),
            format!(
                "record holds chunk {found_id} ({len_codec:08x}), expected {:08x}",
                loc.len_codec()
            ),
        ));
    }
    Ok((fp, &buf[RECORD_HEADER_BYTES..total]))
}

/// The associated data of a sealed chunk payload: the fingerprint and codec of its record.
pub fn chunk_ctx(fp: &Fingerprint, codec: ChunkCodec) -> [u8; 17] {
    let mut c = [0u8; 17];
    c[..16].copy_from_slice(fp);
    c[16] = codec as u8;
    c
}

/// Check one record read from `loc` and return its payload as compressed, opened first in an
/// encrypted pool (`crypto`): the tag is checked before the CRC, so changed bytes are an
/// authentication error, and the record's fingerprint must be `expected` (the chunk table's,
/// when known), so a record swapped in from elsewhere fails too. `what` names the block.
pub fn open_record<'a>(
    buf: &'a [u8],
    id: u64,
    loc: &Location,
    crypto: Option<&Crypto>,
    expected: Option<&Fingerprint>,
    what: impl Fn() -> String,
) -> Result<std::borrow::Cow<'a, [u8]>> {
    let Some(c) = crypto else {
        let (fp, payload) = decode_record(buf, id, loc)?;
        if id == ANY_RECORD_ID && expected != Some(&fp) {
            return Err(Error::corrupt(
                what(),
                format!(
                    "the record in segment {} at offset {} holds another chunk's data",
                    loc.segment, loc.offset
                ),
            ));
        }
        return Ok(std::borrow::Cow::Borrowed(payload));
    };
    let total = loc.record_bytes() as usize;
    let (Some(header), Some(sealed)) = (
        buf.get(..RECORD_HEADER_BYTES),
        buf.get(RECORD_HEADER_BYTES..total),
    ) else {
        return Err(Error::corrupt(what(), "record truncated"));
    };
    let mut fp: Fingerprint = [0u8; 16];
    fp.copy_from_slice(&header[8..24]);
    let plain = c.open(Kind::Chunk, &chunk_ctx(&fp, loc.codec), sealed, &what)?;
    decode_record(buf, id, loc)?;
    if expected.is_some_and(|e| *e != fp) || (id == ANY_RECORD_ID && expected.is_none()) {
        return Err(Error::Auth {
            what: what(),
            detail: format!(
                "the record in segment {} at offset {} holds another chunk's data",
                loc.segment, loc.offset
            ),
        });
    }
    Ok(std::borrow::Cow::Owned(plain))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chunk 7's record of the payload "hello", at offset 0 of segment 1, and its location.
    fn hello_record() -> (Vec<u8>, Location) {
        let mut b = Vec::new();
        encode_record(&mut b, 7, &[4; 16], ChunkCodec::Raw, b"hello");
        let loc = Location {
            segment: 1,
            offset: 0,
            stored_len: 5,
            codec: ChunkCodec::Raw,
        };
        (b, loc)
    }

    #[test]
    fn chunk_record_checks() -> Result<()> {
        let (mut b, loc) = hello_record();
        let (fp, payload) = decode_record(&b, 7, &loc)?;
        assert_eq!((fp, payload), ([4; 16], &b"hello"[..]));
        assert!(decode_record(&b, 8, &loc).is_err());
        b[33] ^= 0x10;
        assert!(matches!(
            decode_record(&b, 7, &loc),
            Err(Error::Checksum { .. })
        ));
        Ok(())
    }

    #[test]
    fn segment_names_and_headers_round_trip() -> Result<()> {
        let uuid = [6; 16];
        assert_eq!(parse_segment_name(&segment_name(0xabc)), Some(0xabc));
        assert_eq!(parse_segment_name("seg-xyz.dat"), None);
        let h = encode_segment_header(42, &uuid);
        assert_eq!(h.len(), SEGMENT_HEADER_BYTES);
        assert_eq!(decode_segment_header(&h, &uuid)?, 42);
        assert!(decode_segment_header(&h, &[7; 16]).is_err(), "another pool");
        for cut in [0, 8, SEGMENT_HEADER_BYTES - 1] {
            assert!(
                decode_segment_header(&h[..cut], &uuid).is_err(),
                "cut {cut}"
            );
        }
        let mut bad = h.clone();
        bad[13] ^= 1;
        assert!(decode_segment_header(&bad, &uuid).is_err(), "CRC");
        let (b, loc) = hello_record();
        for cut in 0..b.len() {
            assert!(
                decode_record(&b[..cut], 7, &loc).is_err(),
                "record cut {cut}"
            );
        }
        Ok(())
    }
}
