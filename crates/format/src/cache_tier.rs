//! The cache tier's files: `cache.conf` in the pool directory ([`CacheConf`]), the headers
//! of `cache.dat` and `cache.idx`, the 64-byte records of the `cache.idx` log, and how a
//! metadata page is keyed in the cache; docs/FORMAT.md "Cache tier".
//!
//! Invariants: a `cache.idx` record is used only if its CRC-32C holds, and the log is read up
//! to the first one that does not (a torn tail); an insert naming a slot past the cache is
//! ignored; parsing never panics on any bytes.

use super::common::Fingerprint;
use crate::error::{Error, Result};
use std::collections::HashMap;

fn crc(b: &[u8]) -> u32 {
    crc32c::crc32c(b)
}

/// The file in the pool directory that says a cache is attached.
pub const CACHE_CONF_NAME: &str = "cache.conf";

pub const CACHE_DATA_MAGIC: [u8; 8] = *b"CNDSCDAT";
pub const CACHE_INDEX_MAGIC: [u8; 8] = *b"CNDSCIDX";
pub const CACHE_VERSION: u32 = 1;
const CONF_FIRST_LINE: &str = "condense-cache 1";
/// Bytes before the first slot of `cache.dat` (the header, padded).
pub const CACHE_DATA_HEADER_BYTES: u64 = 4096;
pub const CACHE_INDEX_HEADER_BYTES: usize = 64;
pub const CACHE_INDEX_RECORD_BYTES: usize = 64;

pub const KIND_INSERT: u8 = 1;
pub const KIND_REMOVE: u8 = 2;
pub const KIND_COUNTERS: u8 = 3;

/// How the cache treats writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheMode {
    /// Writes go to the pool; the cache holds copies of chunks read (nothing is lost with it).
    WriteThrough,
    /// Writes land in the cache first: new segments and the journal are kept in the cache
    /// directory and destaged to the pool's in whole segments (`condense_engine::pool::destage`).
    WriteBack,
}

impl CacheMode {
    pub fn as_str(&self) -> &'static str {
        match self {
            CacheMode::WriteThrough => "writethrough",
            CacheMode::WriteBack => "writeback",
        }
    }

    pub fn parse(s: &str) -> Result<CacheMode> {
        match s {
            "writethrough" => Ok(CacheMode::WriteThrough),
            "writeback" => Ok(CacheMode::WriteBack),
            _ => Err(Error::Invalid(format!(
                "unknown cache mode {s:?}: use writethrough or writeback"
            ))),
        }
    }
}

/// What `cache.conf` in the pool directory says: where the cache is, its size and mode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheConf {
    pub path: String,
    pub size_bytes: u64,
    pub mode: CacheMode,
}

impl CacheConf {
    /// The file's text: a versioned first line, then `key=value` lines.
    pub fn encode(&self) -> String {
        format!(
            "{CONF_FIRST_LINE}\npath={}\nsize_bytes={}\nmode={}\n",
            self.path,
            self.size_bytes,
            self.mode.as_str()
        )
    }

    pub fn decode(bytes: &[u8]) -> Result<CacheConf> {
        let bad = |d: &str| Error::corrupt(CACHE_CONF_NAME, d.to_string());
        let text = std::str::from_utf8(bytes).map_err(|_| bad("not UTF-8 text"))?;
        let mut lines = text.lines();
        if lines.next() != Some(CONF_FIRST_LINE) {
            return Err(bad(&format!("first line is not {CONF_FIRST_LINE:?}")));
        }
        let (mut path, mut size, mut mode) = (None, None, None);
        for l in lines {
            match l.split_once('=') {
                Some(("path", v)) => path = Some(v.to_string()),
                Some(("size_bytes", v)) => {
                    size = Some(
                        v.parse::<u64>()
                            .map_err(|_| bad("size_bytes is no number"))?,
                    )
                }
                Some(("mode", v)) => mode = Some(CacheMode::parse(v)?),
                _ => {}
            }
        }
        Ok(CacheConf {
            path: path.ok_or_else(|| bad("no path= line"))?,
            size_bytes: size.ok_or_else(|| bad("no size_bytes= line"))?,
            mode: mode.ok_or_else(|| bad("no mode= line"))?,
        })
    }
}

/// The persistent counters, in the order they are stored.
pub const N_COUNTERS: usize = 7;

/// Metadata pages share the cache's id space with chunks: chunk ids stay below
/// [`super::common::CHUNK_ID_LIMIT`], page keys have the top bit set.
const PAGE_KEY_BIT: u64 = 1 << 63;

pub fn page_key(page: u64) -> u64 {
    PAGE_KEY_BIT | page
}

/// What stands for a page's fingerprint in its entry: its CRC and length in units.
pub fn page_fp(crc32: u32, units: u16) -> Fingerprint {
    let mut fp = [0u8; 16];
    fp[..4].copy_from_slice(&crc32.to_le_bytes());
    fp[4..6].copy_from_slice(&units.to_le_bytes());
    fp[15] = b'P';
    fp
}

pub fn data_header(uuid: &[u8; 16], slot_bytes: u64, slots: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(64);
    b.extend_from_slice(&CACHE_DATA_MAGIC);
    b.extend_from_slice(&CACHE_VERSION.to_le_bytes());
    b.extend_from_slice(&slots.to_le_bytes());
    b.extend_from_slice(&slot_bytes.to_le_bytes());
    b.extend_from_slice(uuid);
    b.resize(60, 0);
    let c = crc(&b);
    b.extend_from_slice(&c.to_le_bytes());
    b
}

pub fn index_header(uuid: &[u8; 16], slot_bytes: u64, slots: u32) -> Vec<u8> {
    let mut b = data_header(uuid, slot_bytes, slots);
    b[..8].copy_from_slice(&CACHE_INDEX_MAGIC);
    let c = crc(&b[..60]);
    b[60..64].copy_from_slice(&c.to_le_bytes());
    b
}

pub fn record(kind: u8, body: &[u8]) -> [u8; CACHE_INDEX_RECORD_BYTES] {
    let mut r = [0u8; CACHE_INDEX_RECORD_BYTES];
    r[4] = kind;
    r[8..8 + body.len()].copy_from_slice(body);
    let c = crc(&r[4..]);
    r[..4].copy_from_slice(&c.to_le_bytes());
    r
}

pub fn insert_record(slot: u32, id: u64, fp: &Fingerprint, len: u32, data_crc: u32) -> [u8; 64] {
    let mut b = Vec::with_capacity(36);
    b.extend_from_slice(&slot.to_le_bytes());
    b.extend_from_slice(&len.to_le_bytes());
    b.extend_from_slice(&id.to_le_bytes());
    b.extend_from_slice(fp);
    b.extend_from_slice(&data_crc.to_le_bytes());
    record(KIND_INSERT, &b)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// What an index log holds.
pub struct ParsedIndex {
    /// slot -> (id, fingerprint, record length, checksum).
    pub slots: HashMap<u32, (u64, Fingerprint, u32, u32)>,
    pub counters: [u64; N_COUNTERS],
    /// Bytes of the header and the whole records before the first bad one (a torn tail).
    pub good_len: u64,
    pub records: u64,
}

pub fn parse_index(buf: &[u8], slots: u32) -> ParsedIndex {
    let mut p = ParsedIndex {
        slots: HashMap::new(),
        counters: [0; N_COUNTERS],
        good_len: CACHE_INDEX_HEADER_BYTES as u64,
        records: 0,
    };
    let body = buf.get(CACHE_INDEX_HEADER_BYTES..).unwrap_or_default();
    for r in body.chunks_exact(CACHE_INDEX_RECORD_BYTES) {
        if u32_at(r, 0) != crc(&r[4..]) {
            break; // a torn tail
        }
        let b = &r[8..];
        match r[4] {
            KIND_INSERT => {
                let slot = u32_at(b, 0);
                if slot < slots {
                    let mut fp = [0u8; 16];
                    fp.copy_from_slice(&b[16..32]);
                    p.slots
                        .insert(slot, (u64_at(b, 8), fp, u32_at(b, 4), u32_at(b, 32)));
                }
            }
            KIND_REMOVE => {
                p.slots.remove(&u32_at(b, 0));
            }
            KIND_COUNTERS => {
                for (i, c) in p.counters.iter_mut().enumerate() {
                    *c = u64_at(b, i * 8);
                }
            }
            _ => break,
        }
        p.good_len += CACHE_INDEX_RECORD_BYTES as u64;
        p.records += 1;
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conf_round_trips() {
        let c = CacheConf {
            path: "/fast/cache".into(),
            size_bytes: 1 << 30,
            mode: CacheMode::WriteThrough,
        };
        assert_eq!(CacheConf::decode(c.encode().as_bytes()).ok(), Some(c));
        assert!(CacheConf::decode(b"something else\n").is_err());
    }

    #[test]
    fn index_records_round_trip() {
        let (uuid, slot_bytes, slots) = ([9; 16], 4224, 8);
        let mut log = index_header(&uuid, slot_bytes, slots);
        assert_eq!(&log[..8], &CACHE_INDEX_MAGIC);
        assert_eq!(
            &data_header(&uuid, slot_bytes, slots)[..8],
            &CACHE_DATA_MAGIC
        );
        log.extend_from_slice(&insert_record(1, 42, &[3; 16], 4128, 77));
        log.extend_from_slice(&insert_record(2, 43, &page_fp(5, 6), 100, 78));
        log.extend_from_slice(&insert_record(9, 44, &[4; 16], 100, 79)); // past the cache
        log.extend_from_slice(&record(KIND_REMOVE, &2u32.to_le_bytes()));
        let counters: Vec<u8> = (1..=N_COUNTERS as u64).flat_map(u64::to_le_bytes).collect();
        log.extend_from_slice(&record(KIND_COUNTERS, &counters));
        let p = parse_index(&log, slots);
        assert_eq!(p.slots.len(), 1);
        assert_eq!(p.slots.get(&1), Some(&(42, [3; 16], 4128, 77)));
        assert_eq!(p.counters, [1, 2, 3, 4, 5, 6, 7]);
        assert_eq!((p.records, p.good_len), (5, log.len() as u64));
        assert_eq!(page_key(7), (1 << 63) | 7);
    }

    #[test]
    fn a_damaged_or_torn_index_stops_at_the_bad_record() {
        let mut log = index_header(&[1; 16], 4224, 8);
        log.extend_from_slice(&insert_record(1, 42, &[3; 16], 4128, 77));
        log.extend_from_slice(&insert_record(2, 43, &[4; 16], 4128, 78));
        let whole = log.len();
        log[whole - 30] ^= 1; // the second record fails its CRC
        let p = parse_index(&log, 8);
        assert_eq!((p.slots.len(), p.records), (1, 1));
        for cut in 0..whole {
            let p = parse_index(&log[..cut], 8);
            assert!(p.good_len <= cut.max(CACHE_INDEX_HEADER_BYTES) as u64);
        }
        assert!(CacheConf::decode(b"condense-cache 1\npath=/x\nsize_bytes=no\n").is_err());
        assert!(CacheConf::decode(&[0xff, 0xfe]).is_err());
    }
}
