//! Every on-disk encoding of the pool, in one place. `docs/FORMAT.md` mirrors this file.
//!
//! All integers are little-endian. Every structure starts with a magic and a format version
//! (or lives inside one that does) and carries a CRC-32C. Decoders never panic on bad bytes:
//! they return [`Error::Corrupt`] or [`Error::Checksum`].

use crate::crypto::{Crypto, KeySource, KeyWrap, Kind, NonceScheme, MAC_BYTES};
use crate::error::{Error, Result};

/// Format version written by this build, for every structure.
pub const FORMAT_VERSION: u32 = 2;

pub const SUPERBLOCK_NAME: &str = "superblock";
pub const LOCK_NAME: &str = "lock";
pub const CHECKPOINT_NAME: &str = "checkpoint";
pub const CHECKPOINT_TMP_NAME: &str = "checkpoint.tmp";
/// Metadata pages (block maps and the chunk table), written out of place.
pub const META_NAME: &str = "meta.dat";
pub const META_MAGIC: [u8; 8] = *b"CNDSMETA";
pub const SEGMENT_PREFIX: &str = "seg-";
pub const JOURNAL_PREFIX: &str = "journal-";

pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"CNDSPOOL";
pub const SEGMENT_MAGIC: [u8; 8] = *b"CNDSSEGM";
pub const JOURNAL_MAGIC: [u8; 8] = *b"CNDSJRNL";
pub const CHECKPOINT_MAGIC: [u8; 8] = *b"CNDSCKPT";
pub const BATCH_MAGIC: u32 = u32::from_le_bytes(*b"JBAT");

pub const SUPERBLOCK_BYTES: usize = 128;
/// The superblock of an encrypted pool: the 128 bytes above (version
/// [`SUPERBLOCK_VERSION_ENCRYPTED`]) and the key section.
pub const SUPERBLOCK_ENCRYPTED_BYTES: usize = 256;
/// Superblock version of an encrypted pool: format 2 plus encryption with session nonces and
/// the superblock MAC. Older builds refuse it ("unsupported format version 4") instead of
/// misreading the pool.
pub const SUPERBLOCK_VERSION_ENCRYPTED: u32 = 4;
/// Superblock version of an encrypted pool made by older builds (epoch nonces, no MAC): read,
/// never written to (see [`NonceScheme::Epoch`]).
pub const SUPERBLOCK_VERSION_ENCRYPTED_EPOCH: u32 = 3;
/// Where the superblock MAC of an encrypted pool starts: it covers every byte before it.
pub const SUPERBLOCK_MAC_AT: usize = SUPERBLOCK_ENCRYPTED_BYTES - 4 - MAC_BYTES;
pub const SEGMENT_HEADER_BYTES: usize = 64;
pub const RECORD_HEADER_BYTES: usize = 32;
pub const JOURNAL_HEADER_BYTES: usize = 64;
pub const BATCH_HEADER_BYTES: usize = 24;
pub const CHECKPOINT_HEADER_BYTES: usize = 64;
pub const SECTION_HEADER_BYTES: usize = 24;

/// Block map entries: a chunk id, or one of these three markers.
pub const ENTRY_UNMAPPED: u64 = u64::MAX;
pub const ENTRY_ZERO: u64 = u64::MAX - 1;
/// A block `condense repair` declared lost (its data was damaged beyond recovery): reads
/// fail with an I/O error until the block is written again. Names no chunk.
pub const ENTRY_LOST: u64 = u64::MAX - 2;
/// Chunk ids are below this (48 bits: 2^48 chunks, 1 EiB of unique 4 KiB blocks).
pub const CHUNK_ID_LIMIT: u64 = 1 << 48;
/// Entries per block map page (a leaf of 4 KiB holds 512 entries of 8 bytes).
pub const MAP_PAGE_ENTRIES: usize = 512;
/// Chunk-table records per page (32 bytes each).
pub const CHUNKS_PER_PAGE: usize = 128;

/// Stored length of a record payload fits in 24 bits.
pub const STORED_LEN_MAX: u32 = (1 << 24) - 1;
pub const BLOCK_SIZE_MIN: u32 = 4096;
pub const BLOCK_SIZE_MAX: u32 = 65536;
const _: () = assert!(BLOCK_SIZE_MAX < STORED_LEN_MAX);

/// The first 128 bits of a chunk's keyed BLAKE3-256 fingerprint: what the pool stores and
/// compares (collision odds for 2^32 chunks about 2^-64, and the key is secret to the pool).
pub type Fingerprint = [u8; 16];

/// How a chunk's payload is encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkCodec {
    Raw = 0,
    Lz4 = 1,
    Zstd = 2,
}

impl ChunkCodec {
    pub fn from_u8(v: u8) -> Option<ChunkCodec> {
        match v {
            0 => Some(ChunkCodec::Raw),
            1 => Some(ChunkCodec::Lz4),
            2 => Some(ChunkCodec::Zstd),
            _ => None,
        }
    }
}

/// Where a chunk's record is: segment, byte offset of its header, payload length and codec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Location {
    pub segment: u32,
    pub offset: u32,
    pub stored_len: u32,
    pub codec: ChunkCodec,
}

impl Location {
    /// Bytes the record takes in its segment (header and payload).
    pub fn record_bytes(&self) -> u64 {
        RECORD_HEADER_BYTES as u64 + u64::from(self.stored_len)
    }
    fn len_codec(&self) -> u32 {
        self.stored_len | (self.codec as u32) << 24
    }
    fn from_parts(segment: u32, offset: u32, len_codec: u32) -> Result<Location> {
        let codec = ChunkCodec::from_u8((len_codec >> 24) as u8).ok_or_else(|| {
            Error::corrupt(
                "chunk location",
                format!("unknown codec in {len_codec:08x}"),
            )
        })?;
        Ok(Location {
            segment,
            offset,
            stored_len: len_codec & STORED_LEN_MAX,
            codec,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Little-endian helpers.

fn crc(parts: &[&[u8]]) -> u32 {
    parts.iter().fold(0, |c, p| crc32c::crc32c_append(c, p))
}

/// A bounds-checked reader over bytes from disk.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Reader<'a> {
        Reader { buf, pos: 0, what }
    }
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                Error::corrupt(
                    self.what,
                    format!("truncated: need {n} bytes at offset {}", self.pos),
                )
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.bytes(N)?);
        Ok(a)
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.bytes(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    pub fn string(&mut self, len: usize) -> Result<String> {
        String::from_utf8(self.bytes(len)?.to_vec())
            .map_err(|_| Error::corrupt(self.what, "name is not UTF-8"))
    }
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
}

fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}
fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}
fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn check_magic(found: &[u8], magic: &[u8; 8], what: &'static str) -> Result<()> {
    if found != magic {
        return Err(Error::corrupt(what, format!("bad magic {found:02x?}")));
    }
    Ok(())
}

fn check_version(v: u32, what: &'static str) -> Result<()> {
    if v != FORMAT_VERSION {
        return Err(Error::Version {
            what,
            found: v,
            supported: FORMAT_VERSION,
        });
    }
    Ok(())
}

fn check_crc(expected: u32, found: u32, what: impl Into<String>) -> Result<()> {
    if expected != found {
        return Err(Error::Checksum {
            what: what.into(),
            expected,
            found,
        });
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Superblock: the pool's identity and fixed settings. Written once by `init`; in an encrypted
// pool authenticated with a MAC keyed from the data key.

/// The pool's default codec for new chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Lz4,
    Zstd(i8),
}

/// `none`, `lz4`, `zstd:LEVEL`: as `condense init --compression` takes it.
impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Compression::None => f.write_str("none"),
            Compression::Lz4 => f.write_str("lz4"),
            Compression::Zstd(l) => write!(f, "zstd:{l}"),
        }
    }
}

/// When writes are acknowledged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WritePolicy {
    /// `Async` where the pool directory honours flushes, `Sync` otherwise.
    Auto,
    /// Every write is durable before it is acknowledged.
    Sync,
    /// Writes are durable at the next flush (or FUA).
    Async,
}

/// What a flush of a pool in an object store promises (docs/S3.md). Stored in the
/// superblock, so that every host that opens the pool uses the same.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Durability {
    /// A flush returns when the local directory's journal is synced; data and metadata are
    /// uploaded in the background (segments as they fill, checkpoints every 60 s).
    #[default]
    Local,
    /// A flush returns when the store has acknowledged a write-ahead object of it.
    Remote,
}

impl Durability {
    pub fn as_str(self) -> &'static str {
        match self {
            Durability::Local => "local",
            Durability::Remote => "remote",
        }
    }

    pub fn parse(s: &str) -> Option<Durability> {
        match s {
            "local" => Some(Durability::Local),
            "remote" => Some(Durability::Remote),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub block_size: u32,
    pub compression: Compression,
    pub write_policy: WritePolicy,
    /// A pool in an object store: what a flush promises. `None`: a local pool, or a pool in
    /// an object store made before this was stored (its first writable open stores it).
    pub durability: Option<Durability>,
    pub uuid: [u8; 16],
    pub key: [u8; 32],
    pub segment_bytes_target: u64,
    /// Metadata page-cache budget chosen at init (0: the default).
    pub metadata_cache_bytes: u64,
    /// How the data key is wrapped, for an encrypted pool. Then `key` is not stored (zeros
    /// on disk); in memory it holds the fingerprint key derived from the data key.
    pub encryption: Option<KeyWrap>,
}

impl Superblock {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(SUPERBLOCK_BYTES);
        b.extend_from_slice(&SUPERBLOCK_MAGIC);
        put_u32(
            &mut b,
            match &self.encryption {
                Some(w) if w.scheme == NonceScheme::Epoch => SUPERBLOCK_VERSION_ENCRYPTED_EPOCH,
                Some(_) => SUPERBLOCK_VERSION_ENCRYPTED,
                None => FORMAT_VERSION,
            },
        );
        put_u32(&mut b, self.block_size);
        let (codec, level) = match self.compression {
            Compression::None => (0u8, 0i8),
            Compression::Lz4 => (1, 0),
            Compression::Zstd(l) => (2, l),
        };
        b.push(codec);
        b.push(level as u8);
        b.push(match self.write_policy {
            WritePolicy::Auto => 0,
            WritePolicy::Sync => 1,
            WritePolicy::Async => 2,
        });
        b.push(match self.durability {
            None => 0,
            Some(Durability::Local) => 1,
            Some(Durability::Remote) => 2,
        });
        put_u32(&mut b, 0);
        b.extend_from_slice(&self.uuid);
        match self.encryption {
            Some(_) => b.extend_from_slice(&[0u8; 32]),
            None => b.extend_from_slice(&self.key),
        }
        put_u64(&mut b, self.segment_bytes_target);
        put_u64(&mut b, self.metadata_cache_bytes);
        b.resize(SUPERBLOCK_BYTES - 4, 0);
        let c = crc(&[&b]);
        put_u32(&mut b, c);
        if let Some(w) = &self.encryption {
            let (source, m, t, p, salt) = match w.source {
                KeySource::KeyFile => (1u8, 0, 0, 0, [0u8; 16]),
                KeySource::Passphrase { m_kib, t, p, salt } => (2, m_kib, t, p, salt),
            };
            b.push(source);
            b.push(1); // cipher: AES-256-GCM
            put_u16(&mut b, 0);
            put_u32(&mut b, 0); // format 3: the epoch of the last writable open
            put_u32(&mut b, m);
            put_u32(&mut b, t);
            put_u32(&mut b, p);
            b.extend_from_slice(&salt);
            b.extend_from_slice(&w.nonce);
            b.extend_from_slice(&w.wrapped);
            b.resize(SUPERBLOCK_MAC_AT, 0);
            b.extend_from_slice(&w.mac);
            let c = crc(&[&b]);
            put_u32(&mut b, c);
        }
        b
    }

    pub fn decode(buf: &[u8]) -> Result<Superblock> {
        const WHAT: &str = "superblock";
        if buf.len() < SUPERBLOCK_BYTES {
            return Err(Error::corrupt(
                WHAT,
                format!("{} bytes, expected {SUPERBLOCK_BYTES}", buf.len()),
            ));
        }
        let mut r = Reader::new(buf, WHAT);
        check_magic(r.bytes(8)?, &SUPERBLOCK_MAGIC, WHAT)?;
        let version = r.u32()?;
        let scheme = match version {
            SUPERBLOCK_VERSION_ENCRYPTED => Some(NonceScheme::Session),
            SUPERBLOCK_VERSION_ENCRYPTED_EPOCH => Some(NonceScheme::Epoch),
            v => {
                check_version(v, WHAT)?;
                None
            }
        };
        let stored = u32::from_le_bytes(
            buf[SUPERBLOCK_BYTES - 4..SUPERBLOCK_BYTES]
                .try_into()
                .map_err(|_| Error::corrupt(WHAT, "short"))?,
        );
        check_crc(stored, crc(&[&buf[..SUPERBLOCK_BYTES - 4]]), WHAT)?;
        let block_size = r.u32()?;
        let codec = r.u8()?;
        let level = r.u8()? as i8;
        let policy = r.u8()?;
        let durability = r.u8()?;
        let _ = r.u32()?;
        let uuid = r.array()?;
        let key = r.array()?;
        let segment_bytes_target = r.u64()?;
        let metadata_cache_bytes = r.u64()?;
        let compression = match codec {
            0 => Compression::None,
            1 => Compression::Lz4,
            2 => Compression::Zstd(level),
            c => return Err(Error::corrupt(WHAT, format!("unknown compression {c}"))),
        };
        let write_policy = match policy {
            0 => WritePolicy::Auto,
            1 => WritePolicy::Sync,
            2 => WritePolicy::Async,
            p => return Err(Error::corrupt(WHAT, format!("unknown write policy {p}"))),
        };
        let durability = match durability {
            0 => None,
            1 => Some(Durability::Local),
            2 => Some(Durability::Remote),
            d => return Err(Error::corrupt(WHAT, format!("unknown durability {d}"))),
        };
        if !block_size.is_power_of_two() || !(BLOCK_SIZE_MIN..=BLOCK_SIZE_MAX).contains(&block_size)
        {
            return Err(Error::corrupt(WHAT, format!("block size {block_size}")));
        }
        if segment_bytes_target == 0 || segment_bytes_target > u64::from(u32::MAX) {
            return Err(Error::corrupt(
                WHAT,
                format!("segment size {segment_bytes_target}"),
            ));
        }
        let encryption = match scheme {
            Some(scheme) => Some(decode_key_section(buf, scheme)?),
            None => None,
        };
        Ok(Superblock {
            block_size,
            compression,
            write_policy,
            durability,
            uuid,
            key,
            segment_bytes_target,
            metadata_cache_bytes,
            encryption,
        })
    }
}

/// The key section (bytes 128..256) of an encrypted pool's superblock. Its MAC is checked
/// later, with the data key ([`Superblock::check_mac`]); the argon2id parameters are bounded
/// here, before anything can spend memory or time on them.
fn decode_key_section(buf: &[u8], scheme: NonceScheme) -> Result<KeyWrap> {
    const WHAT: &str = "superblock key section";
    let all = buf.get(..SUPERBLOCK_ENCRYPTED_BYTES).ok_or_else(|| {
        Error::corrupt(
            WHAT,
            format!("{} bytes, expected {SUPERBLOCK_ENCRYPTED_BYTES}", buf.len()),
        )
    })?;
    let n = SUPERBLOCK_ENCRYPTED_BYTES - 4;
    let stored = u32::from_le_bytes([all[n], all[n + 1], all[n + 2], all[n + 3]]);
    check_crc(stored, crc(&[&all[..n]]), WHAT)?;
    let mut r = Reader::new(&all[SUPERBLOCK_BYTES..], WHAT);
    let source = r.u8()?;
    let cipher = r.u8()?;
    let _ = r.u16()?;
    let _epoch = r.u32()?;
    let (m_kib, t, p) = (r.u32()?, r.u32()?, r.u32()?);
    let salt = r.array()?;
    let nonce = r.array()?;
    let wrapped = r.array()?;
    let mut mac = [0u8; MAC_BYTES];
    if scheme == NonceScheme::Session {
        mac.copy_from_slice(&all[SUPERBLOCK_MAC_AT..SUPERBLOCK_MAC_AT + MAC_BYTES]);
    }
    if cipher != 1 {
        return Err(Error::corrupt(WHAT, format!("unknown cipher {cipher}")));
    }
    let source = match source {
        1 => KeySource::KeyFile,
        2 => KeySource::Passphrase { m_kib, t, p, salt },
        s => return Err(Error::corrupt(WHAT, format!("unknown key source {s}"))),
    };
    source
        .check_bounds()
        .map_err(|e| Error::corrupt(WHAT, format!("{e}: out of range")))?;
    Ok(KeyWrap {
        source,
        nonce,
        wrapped,
        scheme,
        mac,
    })
}

impl Superblock {
    /// True for a pool encrypted at rest.
    pub fn is_encrypted(&self) -> bool {
        self.encryption.is_some()
    }

    /// Set the MAC of an encrypted pool's superblock (format 4) for its current fields, with
    /// the pool's data key (held by `c`). Call after every change, before encoding to write.
    pub fn authenticate(&mut self, c: &Crypto) {
        let bytes = self.encode();
        if let (Some(w), Some(covered)) = (&mut self.encryption, bytes.get(..SUPERBLOCK_MAC_AT)) {
            w.mac = c.superblock_mac(covered);
        }
    }

    /// Check the MAC of the superblock `buf` (as read from pool `pool`) with the data key held
    /// by `c`: every byte before the MAC must be as the key's holder wrote it.
    pub fn check_mac(buf: &[u8], c: &Crypto, pool: &str) -> Result<()> {
        let (Some(covered), Some(stored)) = (
            buf.get(..SUPERBLOCK_MAC_AT),
            buf.get(SUPERBLOCK_MAC_AT..SUPERBLOCK_MAC_AT + MAC_BYTES),
        ) else {
            return Err(Error::corrupt(
                format!("superblock of pool {pool}"),
                format!("{} bytes, expected {SUPERBLOCK_ENCRYPTED_BYTES}", buf.len()),
            ));
        };
        c.check_superblock_mac(covered, stored, pool)
    }
}

// ---------------------------------------------------------------------------------------------
// Segments: a 64-byte header, then chunk records packed back to back.

pub fn segment_name(id: u32) -> String {
    format!("{SEGMENT_PREFIX}{id:08x}.dat")
}

pub fn parse_segment_name(name: &str) -> Option<u32> {
    let hex = name.strip_prefix(SEGMENT_PREFIX)?.strip_suffix(".dat")?;
    u32::from_str_radix(hex, 16).ok()
}

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
    if found_id != id || len_codec != loc.len_codec() {
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
        return decode_record(buf, id, loc).map(|(_, p)| std::borrow::Cow::Borrowed(p));
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
    if expected.is_some_and(|e| *e != fp) {
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

// ---------------------------------------------------------------------------------------------
// Journal: a 64-byte header naming its generation, then batches of records.

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
    Relocate {
        id: u64,
        loc: Location,
    },
    DropChunk {
        id: u64,
    },
    MetaPut {
        key: String,
        value: Option<Vec<u8>>,
    },
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
            t => return Err(Error::corrupt("journal record", format!("unknown tag {t}"))),
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

// ---------------------------------------------------------------------------------------------
// Checkpoint root: a 64-byte header and one zstd-compressed body holding the small state that
// names everything else (volume list, tree roots, counters, the page bitmap, metadata records).

pub const ROOT_HEADER_BYTES: usize = 64;

/// One volume as recorded in a checkpoint root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RootVolume {
    pub id: u32,
    pub size: u64,
    pub data_blocks: u64,
    pub zero_blocks: u64,
    pub name: String,
    /// For a snapshot: the id of the volume it was taken of (in the snapshot extension).
    pub snapshot_of: Option<u32>,
    /// Seconds since the Unix epoch when it was made; 0 if not known (in the extension).
    pub created: u64,
}

/// One paged tree: which (volume id, or u64::MAX for the chunk table), its height, and the
/// pointer to its root page (first 64-byte unit, CRC, units, codec).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RootTree {
    pub id: u64,
    pub height: u8,
    pub page: u64,
    pub crc: u32,
    pub units: u16,
    pub codec: u8,
}

/// Everything a checkpoint root holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Root {
    pub journal_gen: u64,
    pub next_seq: u64,
    pub next_vol: u32,
    pub volumes: Vec<RootVolume>,
    pub trees: Vec<RootTree>,
    pub next_chunk: u64,
    pub live_chunks: u64,
    pub live_stored_bytes: u64,
    /// (segment, live record bytes)
    pub segment_live: Vec<(u32, u64)>,
    /// Metadata page bytes written over the pool's life (checkpoints and eviction).
    pub meta_bytes_written: u64,
    pub checkpoints: u64,
    /// One bit per page of `meta.dat`: referenced by this root.
    pub bitmap: Vec<u64>,
    pub meta: Vec<(String, Vec<u8>)>,
    /// Pages of `meta.dat` named by more than one parent, with their number of parents
    /// (in the snapshot extension).
    pub shared_pages: Vec<(u64, u32)>,
}

/// Tag and version of the snapshot extension at the end of a root body.
pub const ROOT_SNAPSHOT_EXT_MAGIC: u32 = u32::from_le_bytes(*b"SNAP");
pub const ROOT_SNAPSHOT_EXT_VERSION: u32 = 1;

/// The associated data of a sealed root body: what the header says about it.
fn root_ctx(raw_len: u32, journal_gen: u64, next_seq: u64) -> [u8; 20] {
    let mut c = [0u8; 20];
    c[..4].copy_from_slice(&raw_len.to_le_bytes());
    c[4..12].copy_from_slice(&journal_gen.to_le_bytes());
    c[12..].copy_from_slice(&next_seq.to_le_bytes());
    c
}

/// Encode a checkpoint root; in an encrypted pool (`crypto`) its body is sealed.
pub fn encode_root(root: &Root, uuid: &[u8; 16], crypto: Option<&Crypto>) -> Result<Vec<u8>> {
    let mut b = Vec::new();
    put_u32(&mut b, root.next_vol);
    put_u32(&mut b, root.volumes.len() as u32);
    for v in &root.volumes {
        put_u32(&mut b, v.id);
        put_u64(&mut b, v.size);
        put_u64(&mut b, v.data_blocks);
        put_u64(&mut b, v.zero_blocks);
        put_u16(&mut b, v.name.len() as u16);
        b.extend_from_slice(v.name.as_bytes());
    }
    put_u32(&mut b, root.trees.len() as u32);
    for t in &root.trees {
        put_u64(&mut b, t.id);
        b.push(t.height);
        put_u64(&mut b, t.page);
        put_u32(&mut b, t.crc);
        put_u16(&mut b, t.units);
        b.push(t.codec);
    }
    put_u64(&mut b, root.next_chunk);
    put_u64(&mut b, root.live_chunks);
    put_u64(&mut b, root.live_stored_bytes);
    put_u32(&mut b, root.segment_live.len() as u32);
    for (seg, bytes) in &root.segment_live {
        put_u32(&mut b, *seg);
        put_u64(&mut b, *bytes);
    }
    put_u64(&mut b, root.meta_bytes_written);
    put_u64(&mut b, root.checkpoints);
    put_u64(&mut b, root.bitmap.len() as u64);
    for w in &root.bitmap {
        put_u64(&mut b, *w);
    }
    put_u32(&mut b, root.meta.len() as u32);
    for (k, v) in &root.meta {
        put_u16(&mut b, k.len() as u16);
        b.extend_from_slice(k.as_bytes());
        put_u32(&mut b, v.len() as u32);
        b.extend_from_slice(v);
    }
    // The snapshot extension, only when there is something to say: a pool without
    // snapshots or clones keeps the plain format 2 body.
    let extended: Vec<&RootVolume> = root
        .volumes
        .iter()
        .filter(|v| v.snapshot_of.is_some() || v.created != 0)
        .collect();
    if !extended.is_empty() || !root.shared_pages.is_empty() {
        put_u32(&mut b, ROOT_SNAPSHOT_EXT_MAGIC);
        put_u32(&mut b, ROOT_SNAPSHOT_EXT_VERSION);
        put_u32(&mut b, extended.len() as u32);
        for v in extended {
            put_u32(&mut b, v.id);
            put_u32(&mut b, v.snapshot_of.unwrap_or(u32::MAX));
            put_u64(&mut b, v.created);
        }
        put_u64(&mut b, root.shared_pages.len() as u64);
        for (page, refs) in &root.shared_pages {
            put_u64(&mut b, *page);
            put_u32(&mut b, *refs);
        }
    }
    let body =
        zstd::bulk::compress(&b, 1).map_err(|e| Error::io("compressing the checkpoint root", e))?;
    let raw_len = u32::try_from(b.len()).map_err(|_| {
        Error::Invalid("checkpoint root over 4 GiB (too many metadata records)".into())
    })?;
    let body = match crypto {
        Some(c) => c.sealed(
            Kind::Root,
            &root_ctx(raw_len, root.journal_gen, root.next_seq),
            &body,
        )?,
        None => body,
    };
    let mut out = Vec::with_capacity(ROOT_HEADER_BYTES + body.len());
    out.extend_from_slice(&CHECKPOINT_MAGIC);
    put_u32(&mut out, FORMAT_VERSION);
    put_u32(&mut out, raw_len);
    put_u64(&mut out, root.journal_gen);
    put_u64(&mut out, root.next_seq);
    out.extend_from_slice(uuid);
    put_u32(&mut out, body.len() as u32);
    put_u32(&mut out, crc(&[&body]));
    out.resize(ROOT_HEADER_BYTES - 4, 0);
    let c = crc(&[&out]);
    put_u32(&mut out, c);
    out.extend_from_slice(&body);
    Ok(out)
}

/// Decode a checkpoint root; in an encrypted pool (`crypto`) its body is opened first.
pub fn decode_root(buf: &[u8], uuid: &[u8; 16], crypto: Option<&Crypto>) -> Result<Root> {
    const WHAT: &str = "checkpoint root";
    if buf.len() < ROOT_HEADER_BYTES {
        return Err(Error::corrupt(WHAT, format!("only {} bytes", buf.len())));
    }
    let mut r = Reader::new(buf, WHAT);
    check_magic(r.bytes(8)?, &CHECKPOINT_MAGIC, WHAT)?;
    check_version(r.u32()?, WHAT)?;
    let stored = u32::from_le_bytes([buf[60], buf[61], buf[62], buf[63]]);
    check_crc(stored, crc(&[&buf[..ROOT_HEADER_BYTES - 4]]), WHAT)?;
    let raw_len = r.u32()? as usize;
    let journal_gen = r.u64()?;
    let next_seq = r.u64()?;
    let found_uuid: [u8; 16] = r.array()?;
    if &found_uuid != uuid {
        return Err(Error::corrupt(
            WHAT,
            "the checkpoint belongs to another pool",
        ));
    }
    let body_len = r.u32()? as usize;
    let body_crc = r.u32()?;
    let body = buf
        .get(ROOT_HEADER_BYTES..ROOT_HEADER_BYTES + body_len)
        .ok_or_else(|| Error::corrupt(WHAT, "body truncated"))?;
    check_crc(body_crc, crc(&[body]), WHAT)?;
    let opened;
    let body = match crypto {
        Some(c) => {
            opened = c.open(
                Kind::Root,
                &root_ctx(raw_len as u32, journal_gen, next_seq),
                body,
                || format!("the checkpoint root (file {CHECKPOINT_NAME}, {body_len} bytes at offset {ROOT_HEADER_BYTES})"),
            )?;
            &opened[..]
        }
        None => body,
    };
    let raw = decompress_root(body, raw_len)?;
    let mut r = Reader::new(&raw, WHAT);
    let mut root = Root {
        journal_gen,
        next_seq,
        next_vol: r.u32()?,
        ..Default::default()
    };
    for _ in 0..r.u32()? {
        let id = r.u32()?;
        let size = r.u64()?;
        let data_blocks = r.u64()?;
        let zero_blocks = r.u64()?;
        let n = r.u16()? as usize;
        root.volumes.push(RootVolume {
            id,
            size,
            data_blocks,
            zero_blocks,
            name: r.string(n)?,
            snapshot_of: None,
            created: 0,
        });
    }
    for _ in 0..r.u32()? {
        root.trees.push(RootTree {
            id: r.u64()?,
            height: r.u8()?,
            page: r.u64()?,
            crc: r.u32()?,
            units: r.u16()?,
            codec: r.u8()?,
        });
    }
    root.next_chunk = r.u64()?;
    root.live_chunks = r.u64()?;
    root.live_stored_bytes = r.u64()?;
    for _ in 0..r.u32()? {
        root.segment_live.push((r.u32()?, r.u64()?));
    }
    root.meta_bytes_written = r.u64()?;
    root.checkpoints = r.u64()?;
    let words = r.u64()?;
    if words > r.remaining() as u64 / 8 {
        return Err(Error::corrupt(WHAT, "page bitmap longer than the body"));
    }
    for _ in 0..words {
        root.bitmap.push(r.u64()?);
    }
    for _ in 0..r.u32()? {
        let n = r.u16()? as usize;
        let k = r.string(n)?;
        let n = r.u32()? as usize;
        root.meta.push((k, r.bytes(n)?.to_vec()));
    }
    if r.remaining() != 0 {
        if r.u32()? != ROOT_SNAPSHOT_EXT_MAGIC {
            return Err(Error::corrupt(WHAT, "unknown section after the body"));
        }
        let v = r.u32()?;
        if v != ROOT_SNAPSHOT_EXT_VERSION {
            return Err(Error::corrupt(
                WHAT,
                format!("snapshot section version {v}; this build reads version {ROOT_SNAPSHOT_EXT_VERSION} (upgrade Condense)"),
            ));
        }
        for _ in 0..r.u32()? {
            let id = r.u32()?;
            let of = r.u32()?;
            let created = r.u64()?;
            let vol = root
                .volumes
                .iter_mut()
                .find(|v| v.id == id)
                .ok_or_else(|| {
                    Error::corrupt(WHAT, format!("snapshot section names unknown volume {id}"))
                })?;
            vol.snapshot_of = (of != u32::MAX).then_some(of);
            vol.created = created;
        }
        let n = r.u64()?;
        if n > r.remaining() as u64 / 12 {
            return Err(Error::corrupt(
                WHAT,
                "shared page list longer than the body",
            ));
        }
        for _ in 0..n {
            root.shared_pages.push((r.u64()?, r.u32()?));
        }
    }
    if r.remaining() != 0 {
        return Err(Error::corrupt(WHAT, "bytes left after the body"));
    }
    Ok(root)
}

/// The body of a checkpoint root, which must be `raw_len` bytes. The buffer grows with what
/// the body really holds: `raw_len` is read from the file and never allocated up front (up to
/// 4 GiB for a header of 64 bytes).
fn decompress_root(body: &[u8], raw_len: usize) -> Result<Vec<u8>> {
    use std::io::Read;
    const WHAT: &str = "checkpoint root";
    let bad = |e: std::io::Error| Error::corrupt(WHAT, format!("body does not decompress: {e}"));
    let mut raw = Vec::new();
    zstd::stream::read::Decoder::with_buffer(body)
        .map_err(bad)?
        .take(raw_len as u64 + 1)
        .read_to_end(&mut raw)
        .map_err(bad)?;
    if raw.len() != raw_len {
        return Err(Error::corrupt(
            WHAT,
            format!(
                "body decompresses to {}{} bytes, the header says {raw_len}",
                raw.len(),
                if raw.len() > raw_len { " or more" } else { "" }
            ),
        ));
    }
    Ok(raw)
}

/// The header of `meta.dat` (page 0).
pub fn encode_meta_header(uuid: &[u8; 16]) -> Vec<u8> {
    let mut b = Vec::with_capacity(4096);
    b.extend_from_slice(&META_MAGIC);
    put_u32(&mut b, FORMAT_VERSION);
    put_u32(&mut b, 4096);
    b.extend_from_slice(uuid);
    b.resize(60, 0);
    let c = crc(&[&b]);
    put_u32(&mut b, c);
    b.resize(4096, 0);
    b
}

pub fn decode_meta_header(buf: &[u8], uuid: &[u8; 16]) -> Result<()> {
    const WHAT: &str = "meta.dat header";
    if buf.len() < 64 {
        return Err(Error::corrupt(WHAT, "truncated"));
    }
    let mut r = Reader::new(buf, WHAT);
    check_magic(r.bytes(8)?, &META_MAGIC, WHAT)?;
    check_version(r.u32()?, WHAT)?;
    let page = r.u32()?;
    let found: [u8; 16] = r.array()?;
    let stored = u32::from_le_bytes([buf[60], buf[61], buf[62], buf[63]]);
    check_crc(stored, crc(&[&buf[..60]]), WHAT)?;
    if page != 4096 || &found != uuid {
        return Err(Error::corrupt(
            WHAT,
            "another pool's metadata, or another page size",
        ));
    }
    Ok(())
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn superblock_round_trip_and_damage() -> Result<()> {
        let sb = Superblock {
            block_size: 4096,
            compression: Compression::Zstd(7),
            write_policy: WritePolicy::Sync,
            durability: None,
            uuid: [3; 16],
            key: [9; 32],
            segment_bytes_target: 1 << 26,
            metadata_cache_bytes: 1 << 20,
            encryption: None,
        };
        let mut b = sb.encode();
        assert_eq!(b.len(), SUPERBLOCK_BYTES);
        assert_eq!(Superblock::decode(&b)?, sb);
        b[20] ^= 1;
        assert!(matches!(
            Superblock::decode(&b),
            Err(Error::Checksum { .. })
        ));
        // Encrypted: 256 bytes, version 4, the fingerprint key not stored, the MAC last.
        let mut enc = Superblock {
            encryption: Some(KeyWrap {
                source: KeySource::Passphrase {
                    m_kib: 8,
                    t: 1,
                    p: 1,
                    salt: [4; 16],
                },
                nonce: [5; 12],
                wrapped: [6; 48],
                scheme: NonceScheme::Session,
                mac: [0; MAC_BYTES],
            }),
            ..sb
        };
        let c = Crypto::reader(&[8; 32], enc.uuid, NonceScheme::Session)?;
        enc.authenticate(&c);
        let mut b = enc.encode();
        assert_eq!(b.len(), SUPERBLOCK_ENCRYPTED_BYTES);
        assert_eq!(b[8], 4);
        assert!(b[40..72].iter().all(|&x| x == 0));
        assert_ne!(
            b[SUPERBLOCK_MAC_AT..SUPERBLOCK_MAC_AT + MAC_BYTES],
            [0; MAC_BYTES]
        );
        assert_eq!(
            Superblock::decode(&b)?,
            Superblock {
                key: [0; 32],
                ..enc.clone()
            }
        );
        Superblock::check_mac(&b, &c, "p")?;
        b[200] ^= 1;
        assert!(matches!(
            Superblock::decode(&b),
            Err(Error::Checksum { .. })
        ));
        // Format 3 (older builds): read, with no MAC.
        let old = Superblock {
            encryption: enc.encryption.clone().map(|w| KeyWrap {
                scheme: NonceScheme::Epoch,
                mac: [0; MAC_BYTES],
                ..w
            }),
            ..enc.clone()
        };
        let b = old.encode();
        assert_eq!(b[8], 3);
        assert_eq!(
            Superblock::decode(&b)?,
            Superblock {
                key: [0; 32],
                ..old
            }
        );
        Ok(())
    }

    /// Encode `sb`, let `edit` change the bytes, fix both CRCs as a forger would.
    fn forged(sb: &Superblock, edit: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut b = sb.encode();
        edit(&mut b);
        let c = crc(&[&b[..SUPERBLOCK_BYTES - 4]]);
        b[SUPERBLOCK_BYTES - 4..SUPERBLOCK_BYTES].copy_from_slice(&c.to_le_bytes());
        let n = SUPERBLOCK_ENCRYPTED_BYTES - 4;
        let c = crc(&[&b[..n]]);
        b[n..].copy_from_slice(&c.to_le_bytes());
        b
    }

    fn encrypted_superblock(c: &Crypto) -> Superblock {
        let mut sb = Superblock {
            block_size: 4096,
            compression: Compression::Lz4,
            write_policy: WritePolicy::Sync,
            durability: Some(Durability::Remote),
            uuid: [3; 16],
            key: [0; 32],
            segment_bytes_target: 1 << 26,
            metadata_cache_bytes: 0,
            encryption: Some(KeyWrap {
                source: KeySource::Passphrase {
                    m_kib: 65536,
                    t: 3,
                    p: 1,
                    salt: [4; 16],
                },
                nonce: [5; 12],
                wrapped: [6; 48],
                scheme: NonceScheme::Session,
                mac: [0; MAC_BYTES],
            }),
        };
        sb.authenticate(c);
        sb
    }

    #[test]
    fn every_superblock_byte_before_the_mac_is_authenticated() -> Result<()> {
        let c = Crypto::reader(&[8; 32], [3; 16], NonceScheme::Session)?;
        let sb = encrypted_superblock(&c);
        Superblock::check_mac(&sb.encode(), &c, "p")?;
        // Every byte a forger can change (all but the two CRCs, which it recomputes): the
        // decoder refuses the value, or the MAC does.
        let crcs = [
            SUPERBLOCK_BYTES - 4..SUPERBLOCK_BYTES,
            SUPERBLOCK_ENCRYPTED_BYTES - 4..SUPERBLOCK_ENCRYPTED_BYTES,
        ];
        for at in (0..SUPERBLOCK_ENCRYPTED_BYTES - 4).filter(|i| !crcs[0].contains(i)) {
            let b = forged(&sb, |b| b[at] ^= 0x01);
            let refused = match Superblock::decode(&b) {
                Err(_) => true,
                Ok(_) => Superblock::check_mac(&b, &c, "p").is_err(),
            };
            assert!(refused, "a change at byte {at} went unnoticed");
        }
        // The attack of issue 23: the write policy (durability) edited, the CRC recomputed.
        let b = forged(&sb, |b| b[18] = 2);
        assert!(Superblock::decode(&b).is_ok(), "the forged bytes decode");
        let err = Superblock::check_mac(&b, &c, "/srv/pool")
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("superblock of pool /srv/pool")
                    && e.contains("changed without the key")),
            "{err:?}"
        );
        // Another data key does not vouch for it either.
        let other = Crypto::reader(&[9; 32], [3; 16], NonceScheme::Session)?;
        assert!(Superblock::check_mac(&sb.encode(), &other, "p").is_err());
        Ok(())
    }

    #[test]
    fn argon2_parameters_out_of_bounds_are_a_damaged_superblock() -> Result<()> {
        let c = Crypto::reader(&[8; 32], [3; 16], NonceScheme::Session)?;
        let sb = encrypted_superblock(&c);
        // m_kib at 136, t at 140, p at 144.
        for (at, v) in [
            (136, u32::MAX),
            (136, crate::crypto::ARGON2_M_KIB_MAX + 1),
            (136, 4),
            (140, u32::MAX),
            (140, 0),
            (140, crate::crypto::ARGON2_T_MAX + 1),
            (144, 0),
            (144, crate::crypto::ARGON2_P_MAX + 1),
        ] {
            let b = forged(&sb, |b| b[at..at + 4].copy_from_slice(&v.to_le_bytes()));
            let err = Superblock::decode(&b).err();
            assert!(
                matches!(&err, Some(Error::Corrupt { detail, .. }) if detail.contains("argon2id")),
                "{v} at {at}: {err:?}"
            );
        }
        // The largest values allowed decode (they cost at most 1 GiB and 16 passes).
        let b = forged(&sb, |b| {
            b[136..140].copy_from_slice(&crate::crypto::ARGON2_M_KIB_MAX.to_le_bytes());
            b[140..144].copy_from_slice(&crate::crypto::ARGON2_T_MAX.to_le_bytes());
            b[144..148].copy_from_slice(&crate::crypto::ARGON2_P_MAX.to_le_bytes());
        });
        assert!(Superblock::decode(&b).is_ok());
        Ok(())
    }

    #[test]
    fn superblock_keeps_the_durability_of_a_pool_in_an_object_store() -> Result<()> {
        let mut sb = Superblock {
            block_size: 4096,
            compression: Compression::Lz4,
            write_policy: WritePolicy::Auto,
            durability: None,
            uuid: [1; 16],
            key: [2; 32],
            segment_bytes_target: 1 << 26,
            metadata_cache_bytes: 0,
            encryption: None,
        };
        for (d, byte) in [
            (None, 0),
            (Some(Durability::Local), 1),
            (Some(Durability::Remote), 2),
        ] {
            sb.durability = d;
            let b = sb.encode();
            assert_eq!(b[19], byte);
            assert_eq!(Superblock::decode(&b)?.durability, d);
        }
        // An unknown value with a valid CRC is refused, not read as a default.
        let mut b = sb.encode();
        b[19] = 3;
        let c = crc(&[&b[..SUPERBLOCK_BYTES - 4]]);
        b[SUPERBLOCK_BYTES - 4..].copy_from_slice(&c.to_le_bytes());
        assert!(matches!(Superblock::decode(&b), Err(Error::Corrupt { .. })));
        Ok(())
    }

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
    fn chunk_record_checks() -> Result<()> {
        let mut b = Vec::new();
        encode_record(&mut b, 7, &[4; 16], ChunkCodec::Raw, b"hello");
        let loc = Location {
            segment: 1,
            offset: 0,
            stored_len: 5,
            codec: ChunkCodec::Raw,
        };
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

    /// Found writing the checkpoint_root fuzz target: the root body's length was read from the
    /// header and allocated before decompressing, so a checkpoint of 100 bytes whose header
    /// said 4 GiB (with a CRC, which anyone can compute) allocated 4 GiB. Now the buffer grows
    /// with what the body holds, and a body of another length is an error.
    #[test]
    fn a_root_header_cannot_make_the_decoder_allocate() -> Result<()> {
        let uuid = [5; 16];
        let good = encode_root(&Root::default(), &uuid, None)?;
        assert_eq!(decode_root(&good, &uuid, None)?, Root::default());
        for raw_len in [u32::MAX, 1 << 30, 3] {
            let mut b = good.clone();
            b[12..16].copy_from_slice(&raw_len.to_le_bytes());
            let c = crc(&[&b[..ROOT_HEADER_BYTES - 4]]);
            b[ROOT_HEADER_BYTES - 4..ROOT_HEADER_BYTES].copy_from_slice(&c.to_le_bytes());
            match decode_root(&b, &uuid, None) {
                Err(Error::Corrupt { detail, .. }) => {
                    assert!(detail.contains("decompresses to"), "{detail}")
                }
                other => panic!("raw length {raw_len}: {other:?}"),
            }
        }
        Ok(())
    }
}
