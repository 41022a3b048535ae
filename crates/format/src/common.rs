//! What every structure of the format shares: file names, magics and sizes, the special
//! block-map entries, chunk codecs and locations, the bounds-checked [`Reader`], the
//! little-endian writers, the CRC-32C and the magic/version/CRC checks.

use crate::crypto::MAC_BYTES;
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
/// The suffix of a segment copy not yet complete (a destage or an upload in progress).
pub const PARTIAL_SUFFIX: &str = ".partial";
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
    /// A delta (issue 44): compressed with zstd against one or two base chunks' blocks as a
    /// raw-content dictionary; the payload names the bases ([`crate::reduction::DeltaPayload`]).
    ZstdDelta = 3,
}

/// Most bases a delta record names (its payload and the journal's delta records).
pub const MAX_DELTA_BASES: usize = 2;

impl ChunkCodec {
    /// True for a delta record: its block needs its bases to decode.
    pub fn is_delta(self) -> bool {
        self == ChunkCodec::ZstdDelta
    }

    pub fn from_u8(v: u8) -> Option<ChunkCodec> {
        match v {
            0 => Some(ChunkCodec::Raw),
            1 => Some(ChunkCodec::Lz4),
            2 => Some(ChunkCodec::Zstd),
            3 => Some(ChunkCodec::ZstdDelta),
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
    pub fn len_codec(&self) -> u32 {
        self.stored_len | (self.codec as u32) << 24
    }
    pub fn from_parts(segment: u32, offset: u32, len_codec: u32) -> Result<Location> {
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

pub fn crc(parts: &[&[u8]]) -> u32 {
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

pub fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}
pub fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}
pub fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

pub fn check_magic(found: &[u8], magic: &[u8; 8], what: &'static str) -> Result<()> {
    if found != magic {
        return Err(Error::corrupt(what, format!("bad magic {found:02x?}")));
    }
    Ok(())
}

pub fn check_version(v: u32, what: &'static str) -> Result<()> {
    if v != FORMAT_VERSION {
        return Err(Error::Version {
            what,
            found: v,
            supported: FORMAT_VERSION,
        });
    }
    Ok(())
}

pub fn check_crc(expected: u32, found: u32, what: impl Into<String>) -> Result<()> {
    if expected != found {
        return Err(Error::Checksum {
            what: what.into(),
            expected,
            found,
        });
    }
    Ok(())
}
