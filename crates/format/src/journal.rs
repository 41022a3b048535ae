//! Journal files (`journal-G.wal`): the 64-byte header naming the generation, then batches
//! (a 24-byte header and a payload of records); docs/FORMAT.md "Journal file".
//!
//! Invariants: a batch is valid only if its CRC covers its header fields and payload; a
//! record decoder reads only what its buffer holds (a truncated record is an error); the
//! flush mark is a record every build reads as a no-op.

use super::common::{
    check_crc, check_magic, check_version, crc, put_u16, put_u32, put_u64, Fingerprint, Location,
    Reader, BATCH_HEADER_BYTES, BATCH_MAGIC, FORMAT_VERSION, JOURNAL_HEADER_BYTES, JOURNAL_MAGIC,
    JOURNAL_PREFIX,
};
use crate::error::{Error, Result};

pub fn journal_name(gen: u64) -> String {
    format!("{JOURNAL_PREFIX}{gen:016x}.wal")
}

pub fn parse_journal_name(name: &str) -> Option<u64> {
    let hex = name.strip_prefix(JOURNAL_PREFIX)?.strip_suffix(".wal")?;
    u64::from_str_radix(hex, 16).ok()
}

pub fn encode_journal_header(gen: u64, uuid: &[u8; 16]) -> Vec<u8> {
    let mut b = Vec::with_capacity(JOURNAL_HEADER_BYTES);
    b.extend_from_slice(&JOURNAL_MAGIC);
    put_u32(&mut b, FORMAT_VERSION);
    put_u32(&mut b, 0);
    put_u64(&mut b, gen);
    b.extend_from_slice(uuid);
    b.resize(JOURNAL_HEADER_BYTES - 4, 0);
    let c = crc(&[&b]);
    put_u32(&mut b, c);
    b
}

/// Whether the 64-byte header at the start of `buf` (a journal's or `meta.dat`'s: fields,
/// then the CRC-32C of bytes 0..60) is whole. One that is not is damage; every field of
/// either header is known from elsewhere (the file name, the superblock), so it is rebuilt.
pub fn header_intact(buf: &[u8]) -> bool {
    buf.get(..60)
        .zip(buf.get(60..64))
        .is_some_and(|(body, c)| crc(&[body]) == u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

pub fn decode_journal_header(buf: &[u8], uuid: &[u8; 16]) -> Result<u64> {
    const WHAT: &str = "journal header";
    if buf.len() < JOURNAL_HEADER_BYTES {
        return Err(Error::corrupt(
            WHAT,
            format!(
                "journal truncated to {} bytes (header needs {JOURNAL_HEADER_BYTES})",
                buf.len()
            ),
        ));
    }
    let mut r = Reader::new(buf, WHAT);
    check_magic(r.bytes(8)?, &JOURNAL_MAGIC, WHAT)?;
    check_version(r.u32()?, WHAT)?;
    let _ = r.u32()?;
    let gen = r.u64()?;
    let found_uuid: [u8; 16] = r.array()?;
    let mut r2 = Reader::new(&buf[JOURNAL_HEADER_BYTES - 4..], WHAT);
    check_crc(r2.u32()?, crc(&[&buf[..JOURNAL_HEADER_BYTES - 4]]), WHAT)?;
    if &found_uuid != uuid {
        return Err(Error::corrupt(WHAT, "journal belongs to another pool"));
    }
    Ok(gen)
}

/// The key of the record a flush ends its batch with: `MetaPut` of this key, absent, which
/// changes no state (the key is never present) and reads as that no-op to any build. Replay
/// uses it to tell an acknowledged batch from an unacknowledged one (crate::journal).
pub const FLUSH_MARK_KEY: &str = "journal/flushed";

impl JournalRecord {
    /// The record a flush appends last to its batch.
    pub fn flush_mark() -> JournalRecord {
        JournalRecord::MetaPut {
            key: FLUSH_MARK_KEY.to_string(),
            value: None,
        }
    }

    pub fn is_flush_mark(&self) -> bool {
        matches!(self, JournalRecord::MetaPut { key, value: None } if key == FLUSH_MARK_KEY)
    }
}

/// One metadata change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JournalRecord {
    NewChunk {
        id: u64,
        loc: Location,
        fp: Fingerprint,
    },
    MapRun {
        vol: u32,
        start: u64,
        entries: Vec<u64>,
    },
    MapFill {
        vol: u32,
        start: u64,
        count: u64,
        entry: u64,
    },
    VolumeCreate {
        vol: u32,
        size: u64,
        name: String,
    },
    VolumeResize {
        vol: u32,
        size: u64,
    },
    VolumeDelete {
        vol: u32,
    },
    /// Leaves `[from, to)` of tree `tree` (a deleted volume's map, detached at or above
    /// [`crate::root::RELEASE_TREE_FIRST`] inside a checkpoint) released: pages only it holds freed, the
    /// chunks their entries name one reference fewer, and the pointers to them cleared. A
    /// shared subtree reaching into the range is let go whole. The last step has `to` =
    /// `u64::MAX`: the rest of the tree goes and the release is over.
    ReleaseStep {
        tree: u64,
        from: u64,
        to: u64,
    },
    Relocate {
        id: u64,
        loc: Location,
    },
    DropChunk {
        id: u64,
    },
    /// Chunk `id` is a duplicate of chunk `to` (same fingerprint, found by the merge pass):
    /// its slot becomes a forward to `to`, which takes over its references; its own record
    /// is dead space for GC. Only after a root of version [`crate::root::ROOT_VERSION_FORWARDS`].
    Forward {
        id: u64,
        to: u64,
    },
    MetaPut {
        key: String,
        value: Option<Vec<u8>>,
    },
    /// A new chunk whose record is a delta against `bases` (1 or 2 chunks with records, never
    /// deltas): applied as `NewChunk` plus one reference on each base, so a base lives while
    /// a delta names it. Only after a root of version [`crate::root::ROOT_VERSION_DELTAS`].
    NewDelta {
        id: u64,
        loc: Location,
        fp: Fingerprint,
        bases: Vec<u64>,
    },
    /// Delta chunk `id`, which nothing names, dropped by GC: `DropChunk` plus the references
    /// its `bases` (read from its record) held dropped.
    DropDelta {
        id: u64,
        bases: Vec<u64>,
    },
}

/// A `NewDelta` (with its location and fingerprint) or a `DropDelta` (without).
fn put_delta(out: &mut Vec<u8>, id: u64, new: Option<(&Location, &Fingerprint)>, bases: &[u64]) {
    out.push(if new.is_some() { 13 } else { 14 });
    put_u64(out, id);
    if let Some((loc, fp)) = new {
        put_u32(out, loc.segment);
        put_u32(out, loc.offset);
        put_u32(out, loc.len_codec());
        out.extend_from_slice(fp);
    }
    put_bases(out, bases);
}

/// The fields of a `NewDelta` after its tag.
fn get_new_delta(r: &mut Reader<'_>) -> Result<JournalRecord> {
    let id = r.u64()?;
    let (s, o, lc) = (r.u32()?, r.u32()?, r.u32()?);
    let loc = Location::from_parts(s, o, lc)?;
    let fp = r.array()?;
    let bases = get_bases(r)?;
    Ok(JournalRecord::NewDelta { id, loc, fp, bases })
}

/// The bases of a `NewDelta`/`DropDelta`: a count (u8) and that many ids.
fn put_bases(out: &mut Vec<u8>, bases: &[u64]) {
    out.push(bases.len() as u8);
    for b in bases {
        put_u64(out, *b);
    }
}

fn get_bases(r: &mut Reader<'_>) -> Result<Vec<u64>> {
    let n = usize::from(r.u8()?);
    if n == 0 || n > crate::common::MAX_DELTA_BASES {
        return Err(Error::corrupt(
            "journal record",
            format!("a delta with {n} bases"),
        ));
    }
    (0..n).map(|_| r.u64()).collect()
}

impl JournalRecord {
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            JournalRecord::NewChunk { id, loc, fp } => {
                out.push(1);
                put_u64(out, *id);
                put_u32(out, loc.segment);
                put_u32(out, loc.offset);
                put_u32(out, loc.len_codec());
                out.extend_from_slice(fp);
            }
            JournalRecord::MapRun {
                vol,
                start,
                entries,
            } => {
                out.push(2);
                put_u32(out, *vol);
                put_u64(out, *start);
                put_u32(out, entries.len() as u32);
                for e in entries {
                    put_u64(out, *e);
                }
            }
            JournalRecord::MapFill {
                vol,
                start,
                count,
                entry,
            } => {
                out.push(3);
                put_u32(out, *vol);
                put_u64(out, *start);
                put_u64(out, *count);
                put_u64(out, *entry);
            }
            JournalRecord::VolumeCreate { vol, size, name } => {
                out.push(4);
                put_u32(out, *vol);
                put_u64(out, *size);
                put_u16(out, name.len() as u16);
                out.extend_from_slice(name.as_bytes());
            }
            JournalRecord::VolumeResize { vol, size } => {
                out.push(5);
                put_u32(out, *vol);
                put_u64(out, *size);
            }
            JournalRecord::VolumeDelete { vol } => {
                out.push(6);
                put_u32(out, *vol);
            }
            JournalRecord::ReleaseStep { tree, from, to } => {
                out.push(11);
                put_u64(out, *tree);
                put_u64(out, *from);
                put_u64(out, *to);
            }
            JournalRecord::Relocate { id, loc } => {
                out.push(7);
                put_u64(out, *id);
                put_u32(out, loc.segment);
                put_u32(out, loc.offset);
                put_u32(out, loc.len_codec());
            }
            JournalRecord::DropChunk { id } => {
                out.push(8);
                put_u64(out, *id);
            }
            JournalRecord::Forward { id, to } => {
                out.push(12);
                put_u64(out, *id);
                put_u64(out, *to);
            }
            JournalRecord::NewDelta { id, loc, fp, bases } => {
                put_delta(out, *id, Some((loc, fp)), bases)
            }
            JournalRecord::DropDelta { id, bases } => put_delta(out, *id, None, bases),
            JournalRecord::MetaPut { key, value } => {
                out.push(9);
                put_u16(out, key.len() as u16);
                out.extend_from_slice(key.as_bytes());
                match value {
                    Some(v) => {
                        out.push(1);
                        put_u32(out, v.len() as u32);
                        out.extend_from_slice(v);
                    }
                    None => out.push(0),
                }
            }
        }
    }

    pub fn decode(r: &mut Reader<'_>) -> Result<JournalRecord> {
        let tag = r.u8()?;
        Ok(match tag {
            1 => {
                let id = r.u64()?;
                let (s, o, lc) = (r.u32()?, r.u32()?, r.u32()?);
                JournalRecord::NewChunk {
                    id,
                    loc: Location::from_parts(s, o, lc)?,
                    fp: r.array()?,
                }
            }
            2 => {
                let vol = r.u32()?;
                let start = r.u64()?;
                let n = r.u32()? as usize;
                if n > r.remaining() / 8 {
                    return Err(Error::corrupt(
                        "journal record",
                        "map run longer than its batch",
                    ));
                }
                let mut entries = Vec::with_capacity(n);
                for _ in 0..n {
                    entries.push(r.u64()?);
                }
                JournalRecord::MapRun {
                    vol,
                    start,
                    entries,
                }
            }
            3 => JournalRecord::MapFill {
                vol: r.u32()?,
                start: r.u64()?,
                count: r.u64()?,
                entry: r.u64()?,
            },
            4 => {
                let vol = r.u32()?;
                let size = r.u64()?;
                let n = r.u16()? as usize;
                JournalRecord::VolumeCreate {
                    vol,
                    size,
                    name: r.string(n)?,
                }
            }
            5 => JournalRecord::VolumeResize {
                vol: r.u32()?,
                size: r.u64()?,
            },
            6 => JournalRecord::VolumeDelete { vol: r.u32()? },
            7 => {
                let id = r.u64()?;
                let (s, o, lc) = (r.u32()?, r.u32()?, r.u32()?);
                JournalRecord::Relocate {
                    id,
                    loc: Location::from_parts(s, o, lc)?,
                }
            }
            8 => JournalRecord::DropChunk { id: r.u64()? },
            12 => JournalRecord::Forward {
                id: r.u64()?,
                to: r.u64()?,
            },
            13 => get_new_delta(r)?,
            14 => JournalRecord::DropDelta {
                id: r.u64()?,
                bases: get_bases(r)?,
            },
            9 => {
                let n = r.u16()? as usize;
                let key = r.string(n)?;
                let value = match r.u8()? {
                    0 => None,
                    _ => {
                        let n = r.u32()? as usize;
                        Some(r.bytes(n)?.to_vec())
                    }
                };
                JournalRecord::MetaPut { key, value }
            }
            11 => JournalRecord::ReleaseStep {
                tree: r.u64()?,
                from: r.u64()?,
                to: r.u64()?,
            },
            t => {
                return Err(Error::corrupt(
                    "journal record",
                    format!("unknown tag {t} (written by a newer Condense? upgrade it)"),
                ))
            }
        })
    }
}

/// A batch as written: header (magic, payload length, sequence, CRC, record count) + payload.
pub fn encode_batch(seq: u64, count: u32, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(BATCH_HEADER_BYTES + payload.len());
    put_u32(&mut b, BATCH_MAGIC);
    put_u32(&mut b, payload.len() as u32);
    put_u64(&mut b, seq);
    put_u32(&mut b, 0);
    put_u32(&mut b, count);
    let c = crc(&[&b[..16], &b[20..24], payload]);
    b[16..20].copy_from_slice(&c.to_le_bytes());
    b.extend_from_slice(payload);
    b
}

/// A batch header read back: (payload length, sequence, crc, count), or None if it is not one.
pub struct BatchHeader {
    pub payload_len: u32,
    pub seq: u64,
    pub crc: u32,
    pub count: u32,
}

pub fn decode_batch_header(buf: &[u8]) -> Option<BatchHeader> {
    let mut r = Reader::new(buf, "journal batch");
    if r.u32().ok()? != BATCH_MAGIC {
        return None;
    }
    Some(BatchHeader {
        payload_len: r.u32().ok()?,
        seq: r.u64().ok()?,
        crc: r.u32().ok()?,
        count: r.u32().ok()?,
    })
}

/// True if the batch's payload matches its header's checksum.
pub fn batch_valid(header_bytes: &[u8], h: &BatchHeader, payload: &[u8]) -> bool {
    header_bytes.len() >= BATCH_HEADER_BYTES
        && h.crc == crc(&[&header_bytes[..16], &header_bytes[20..24], payload])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ChunkCodec, ENTRY_UNMAPPED, ENTRY_ZERO};
    #[test]
    fn records_round_trip() -> Result<()> {
        let recs = vec![
            JournalRecord::NewChunk {
                id: 5,
                loc: Location {
                    segment: 2,
                    offset: 64,
                    stored_len: 100,
                    codec: ChunkCodec::Lz4,
                },
                fp: [1; 16],
            },
            JournalRecord::MapRun {
                vol: 1,
                start: 7,
                entries: vec![5, ENTRY_ZERO, ENTRY_UNMAPPED],
            },
            JournalRecord::MapFill {
                vol: 1,
                start: 9,
                count: 1 << 40,
                entry: ENTRY_UNMAPPED,
            },
            JournalRecord::VolumeCreate {
                vol: 3,
                size: 1 << 30,
                name: "vm-1".into(),
            },
            JournalRecord::VolumeResize { vol: 3, size: 4096 },
            JournalRecord::VolumeDelete { vol: 3 },
            JournalRecord::ReleaseStep {
                tree: (1 << 32) + 1,
                from: 16,
                to: u64::MAX,
            },
            JournalRecord::Relocate {
                id: 5,
                loc: Location {
                    segment: 9,
                    offset: 4096,
                    stored_len: 4096,
                    codec: ChunkCodec::Raw,
                },
            },
            JournalRecord::DropChunk { id: 5 },
            JournalRecord::Forward { id: 6, to: 2 },
            JournalRecord::NewDelta {
                id: 9,
                loc: Location {
                    segment: 1,
                    offset: 64,
                    stored_len: 100,
                    codec: ChunkCodec::ZstdDelta,
                },
                fp: [3; 16],
                bases: vec![2, 6],
            },
            JournalRecord::DropDelta {
                id: 9,
                bases: vec![2],
            },
            JournalRecord::MetaPut {
                key: "fs/x".into(),
                value: Some(vec![1, 2]),
            },
            JournalRecord::MetaPut {
                key: "fs/y".into(),
                value: None,
            },
        ];
        let mut b = Vec::new();
        for r in &recs {
            r.encode(&mut b);
        }
        let mut rd = Reader::new(&b, "test");
        for r in &recs {
            assert_eq!(&JournalRecord::decode(&mut rd)?, r);
        }
        assert_eq!(rd.remaining(), 0);
        // Truncated input is an error, not a panic.
        for cut in 0..b.len() {
            let mut rd = Reader::new(&b[..cut], "test");
            while rd.remaining() > 0 {
                if JournalRecord::decode(&mut rd).is_err() {
                    break;
                }
            }
        }
        Ok(())
    }

    #[test]
    fn journal_headers_and_batches_round_trip() -> Result<()> {
        let uuid = [8; 16];
        assert_eq!(parse_journal_name(&journal_name(0x1234)), Some(0x1234));
        let h = encode_journal_header(9, &uuid);
        assert!(header_intact(&h));
        assert_eq!(decode_journal_header(&h, &uuid)?, 9);
        assert!(decode_journal_header(&h, &[1; 16]).is_err(), "another pool");
        for cut in [0, 8, JOURNAL_HEADER_BYTES - 1] {
            assert!(
                decode_journal_header(&h[..cut], &uuid).is_err(),
                "cut {cut}"
            );
            assert!(!header_intact(&h[..cut]));
        }
        let mut bad = h.clone();
        bad[16] ^= 1;
        assert!(!header_intact(&bad) && decode_journal_header(&bad, &uuid).is_err());

        let mut payload = Vec::new();
        JournalRecord::flush_mark().encode(&mut payload);
        let b = encode_batch(77, 1, &payload);
        let bh = decode_batch_header(&b).expect("a batch header");
        assert_eq!(
            (bh.payload_len as usize, bh.seq, bh.count),
            (payload.len(), 77, 1)
        );
        let body = &b[BATCH_HEADER_BYTES..];
        assert!(batch_valid(&b, &bh, body));
        let mut rd = Reader::new(body, "test");
        assert!(JournalRecord::decode(&mut rd)?.is_flush_mark());
        assert!(
            !batch_valid(&b, &bh, &body[..body.len() - 1]),
            "short payload"
        );
        for cut in 0..BATCH_HEADER_BYTES {
            let _ = decode_batch_header(&b[..cut]); // None or a header, never a panic
            assert!(!batch_valid(&b[..cut], &bh, body) || cut >= BATCH_HEADER_BYTES);
        }
        assert!(
            decode_batch_header(b"XXXXXXXXXXXXXXXXXXXXXXXX").is_none(),
            "bad magic"
        );
        Ok(())
    }
}
