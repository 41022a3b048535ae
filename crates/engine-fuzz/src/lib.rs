//! Entry points of the fuzz targets (`fuzz/fuzz_targets/`): one function per decoder of bytes
//! that come from the pool directory, the cache directory or a bucket. A crate of its own so
//! that none of it is in the release binary: only fuzz/ and this crate's tests use it.
//!
//! Each function takes arbitrary bytes, returns whether they decoded, and must never panic,
//! allocate without bound or hang on them. Where the decoder has an encoder, what decodes must encode and decode back to the same
//! value (a round trip finds more than "does not panic"). Inputs that carry checksums start
//! with a flags byte: with [`FIX_CHECKSUMS`] set, the function first recomputes every CRC in
//! the input, so that mutations reach the code behind the checksum instead of stopping at it.
//! Encrypted objects are opened with [`FUZZ_DATA_KEY`]; the seed corpus (written by
//! [`write_seeds`]) holds objects sealed with it, so the fuzzer starts from inputs that open.

#![deny(clippy::unwrap_used)]

use condense_engine::cache_tier::{self, CacheConf, CacheMode, ChunkCache};
use condense_engine::chunk_table;
use condense_engine::crypto::{self, Crypto, Kind, UserKey};
use condense_engine::format::{self, JournalRecord, Location, Superblock};
use condense_engine::io::{Dir, File};
use condense_engine::journal::{Journal, ReplayMode};
use condense_engine::page_cache::{self, Ptr, CHUNK_TREE, PAGE_BYTES, UNIT};
use condense_engine::remote::{self, RemoteConf};
use condense_engine::segment::Segments;
use condense_engine::sim::{SimDir, SimHandle};
use std::collections::HashMap;
use std::sync::Arc;

/// Flags byte: recompute the input's checksums before decoding it.
pub const FIX_CHECKSUMS: u8 = 1;
/// Flags byte: the input belongs to an encrypted pool (open it with [`FUZZ_DATA_KEY`]).
pub const ENCRYPTED: u8 = 2;
/// The data key of the fuzzed encrypted objects.
pub const FUZZ_DATA_KEY: [u8; 32] = [0x5a; 32];
/// The user key that wraps the data key in the fuzzed superblocks.
pub const FUZZ_USER_KEY: [u8; 32] = [0xa5; 32];
/// The unit of `meta.dat` a fuzzed metadata page is read from (part of a sealed page's context).
pub const FUZZ_PAGE: u64 = 7;

fn crc(parts: &[&[u8]]) -> u32 {
    parts.iter().fold(0, |c, p| crc32c::crc32c_append(c, p))
}

fn put_crc(buf: &mut [u8], at: usize, value: u32) {
    if let Some(s) = buf.get_mut(at..at + 4) {
        s.copy_from_slice(&value.to_le_bytes());
    }
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

fn uuid_at(b: &[u8], at: usize) -> [u8; 16] {
    let mut u = [0u8; 16];
    if let Some(s) = b.get(at..at + 16) {
        u.copy_from_slice(s);
    }
    u
}

/// The flags byte and the rest of the input.
fn split(data: &[u8]) -> Option<(u8, &[u8])> {
    data.split_first().map(|(f, rest)| (*f, rest))
}

fn fuzz_crypto(uuid: [u8; 16]) -> Option<Crypto> {
    Crypto::reader(
        &FUZZ_DATA_KEY,
        uuid,
        condense_engine::crypto::NonceScheme::Session,
    )
    .and_then(|c| c.start_session("fuzz"))
    .ok()
}

/// A file of a fresh simulated directory holding `bytes`.
fn sim_file(dir: &SimHandle, name: &str, bytes: &[u8]) -> Option<Arc<dyn File>> {
    let f = dir.open(name, true).ok()?;
    f.write_at(bytes, 0).ok()?;
    Some(f)
}

// ---------------------------------------------------------------------------------------------
// The superblock.

/// `superblock` (flags byte, then the file).
pub fn superblock(data: &[u8]) -> bool {
    let Some((flags, rest)) = split(data) else {
        return false;
    };
    let mut buf = rest.to_vec();
    if flags & FIX_CHECKSUMS != 0 {
        if buf.len() >= format::SUPERBLOCK_BYTES {
            let c = crc(&[&buf[..format::SUPERBLOCK_BYTES - 4]]);
            put_crc(&mut buf, format::SUPERBLOCK_BYTES - 4, c);
        }
        if buf.len() >= format::SUPERBLOCK_ENCRYPTED_BYTES {
            let n = format::SUPERBLOCK_ENCRYPTED_BYTES - 4;
            let c = crc(&[&buf[..n]]);
            put_crc(&mut buf, n, c);
        }
    }
    let Ok(sb) = Superblock::decode(&buf) else {
        return false;
    };
    // The fingerprint key of an encrypted pool is not stored: it decodes as zeros.
    let expected = Superblock {
        key: if sb.is_encrypted() { [0; 32] } else { sb.key },
        ..sb.clone()
    };
    match Superblock::decode(&sb.encode()) {
        Ok(again) => assert_eq!(again, expected, "superblock round trip"),
        Err(e) => panic!("an encoded superblock does not decode: {e}"),
    }
    // A key-file pool: unwrapping with the fuzz key either fails cleanly or gives a key.
    // (A passphrase pool runs argon2 with the parameters read: bounded by the crypto module,
    // and too slow to run per input.)
    if let Some(w) = sb.encryption.as_ref() {
        if w.source == crypto::KeySource::KeyFile {
            let _ = crypto::unwrap_data_key(&UserKey::key(FUZZ_USER_KEY), w, &sb.uuid, "fuzz");
        }
    }
    true
}

// ---------------------------------------------------------------------------------------------
// The checkpoint root.

fn fix_root(buf: &mut [u8]) {
    let hb = format::ROOT_HEADER_BYTES;
    if buf.len() < hb {
        return;
    }
    let body_len = u32_at(buf, 48).unwrap_or(0) as usize;
    if let Some(body) = buf.get(hb..hb.saturating_add(body_len)) {
        let c = crc(&[body]);
        put_crc(buf, 52, c);
    }
    let c = crc(&[&buf[..hb - 4]]);
    put_crc(buf, hb - 4, c);
}

/// `checkpoint` (flags byte, then the file; the pool's UUID is the one its header names).
pub fn checkpoint_root(data: &[u8]) -> bool {
    let Some((flags, rest)) = split(data) else {
        return false;
    };
    let mut buf = rest.to_vec();
    if flags & FIX_CHECKSUMS != 0 {
        fix_root(&mut buf);
    }
    let uuid = uuid_at(&buf, 32);
    let crypto = if flags & ENCRYPTED != 0 {
        fuzz_crypto(uuid)
    } else {
        None
    };
    let Ok(root) = format::decode_root(&buf, &uuid, crypto.as_ref()) else {
        return false;
    };
    let encoded = match format::encode_root(&root, &uuid, crypto.as_ref()) {
        Ok(e) => e,
        Err(e) => panic!("a decoded checkpoint root does not encode: {e}"),
    };
    match format::decode_root(&encoded, &uuid, crypto.as_ref()) {
        Ok(again) => assert_eq!(again, root, "checkpoint root round trip"),
        Err(e) => panic!("an encoded checkpoint root does not decode: {e}"),
    }
    true
}

// ---------------------------------------------------------------------------------------------
// The journal.

/// Recompute the header CRC, and number the batches from the first one's sequence and
/// recompute their CRCs, as far as they are whole.
fn fix_journal(buf: &mut [u8]) {
    let jh = format::JOURNAL_HEADER_BYTES;
    if buf.len() < jh {
        return;
    }
    let c = crc(&[&buf[..jh - 4]]);
    put_crc(buf, jh - 4, c);
    let bh = format::BATCH_HEADER_BYTES;
    let mut pos = jh;
    let mut seq = None;
    while u32_at(buf, pos) == Some(format::BATCH_MAGIC) && pos + bh <= buf.len() {
        let len = u32_at(buf, pos + 4).unwrap_or(0) as usize;
        let end = pos + bh + len;
        if end > buf.len() {
            break;
        }
        let s = *seq.get_or_insert(u64_at(buf, pos + 8).unwrap_or(0));
        buf[pos + 8..pos + 16].copy_from_slice(&s.to_le_bytes());
        seq = Some(s.wrapping_add(1));
        let c = crc(&[
            &buf[pos..pos + 16],
            &buf[pos + 20..pos + 24],
            &buf[pos + bh..end],
        ]);
        put_crc(buf, pos + 16, c);
        pos = end;
    }
}

/// A record decoded from disk encodes and decodes back to itself.
fn record_round_trip(rec: &JournalRecord) {
    let mut b = Vec::new();
    rec.encode(&mut b);
    let mut r = format::Reader::new(&b, "fuzz");
    match JournalRecord::decode(&mut r) {
        Ok(again) => assert_eq!(&again, rec, "journal record round trip"),
        Err(e) => panic!("an encoded journal record does not decode: {e}"),
    }
    assert_eq!(
        r.remaining(),
        0,
        "journal record encoding has bytes left over"
    );
}

/// `journal-G.wal` (flags byte, then the file). Replayed in the mode the flags' bits 2-3 name
/// (read-only, salvage, writable), from the generation and UUID its header names and the
/// sequence number of its first batch.
pub fn journal(data: &[u8]) -> bool {
    let Some((flags, rest)) = split(data) else {
        return false;
    };
    let mut buf = rest.to_vec();
    if flags & FIX_CHECKSUMS != 0 {
        fix_journal(&mut buf);
    }
    let gen = u64_at(&buf, 16).unwrap_or(0);
    let uuid = uuid_at(&buf, 24);
    let first_seq = u64_at(&buf, format::JOURNAL_HEADER_BYTES + 8).unwrap_or(0);
    let mode = match (flags >> 2) & 3 {
        0 => ReplayMode::ReadOnly,
        1 => ReplayMode::Salvage,
        _ => ReplayMode::Writable,
    };
    let crypto = if flags & ENCRYPTED != 0 {
        fuzz_crypto(uuid).map(Arc::new)
    } else {
        None
    };
    let dir = SimHandle(SimDir::new());
    if sim_file(&dir, &format::journal_name(gen), &buf).is_none() {
        return false;
    }
    let replayed = Journal::replay(&dir, gen, &uuid, first_seq, mode, crypto, |records, _| {
        records.iter().for_each(record_round_trip);
        Ok(true)
    });
    let mut decoded = false;
    if let Ok((_, report)) = replayed {
        decoded = report.records > 0;
        for d in &report.damaged {
            d.records.iter().for_each(record_round_trip);
            assert!(
                d.offset + d.bytes <= buf.len() as u64,
                "damage past the file"
            );
        }
        assert!(
            report.torn_bytes <= buf.len() as u64,
            "torn tail longer than the file"
        );
    }
    // The records alone, without batch framing, as a payload holds them.
    let mut r = format::Reader::new(rest, "fuzz");
    while r.remaining() > 0 {
        match JournalRecord::decode(&mut r) {
            Ok(rec) => record_round_trip(&rec),
            Err(_) => break,
        }
    }
    decoded
}

// ---------------------------------------------------------------------------------------------
// Metadata pages.

/// The flags byte of [`meta_page`]: bits 0-1 FIX_CHECKSUMS and ENCRYPTED as elsewhere, bits
/// 2-3 the pointer's codec (3: an unknown one), bit 4 a chunk-table page (else a block map),
/// bit 5 an interior page (level 1, else a leaf).
pub fn meta_page_flags(codec: u8, chunk_table: bool, interior: bool, encrypted: bool) -> u8 {
    FIX_CHECKSUMS
        | if encrypted { ENCRYPTED } else { 0 }
        | (codec & 3) << 2
        | if chunk_table { 16 } else { 0 }
        | if interior { 32 } else { 0 }
}

/// A page of `meta.dat` as stored (flags byte, then the stored units), read through the
/// pointer its parent would hold; then the page's contents: pointers, block-map entries or
/// chunk-table records, each through its own decoder and encoder.
pub fn meta_page(data: &[u8]) -> bool {
    let Some((flags, stored)) = split(data) else {
        return false;
    };
    let _ = format::decode_meta_header(stored, &uuid_at(stored, 16));
    let tree = if flags & 16 != 0 { CHUNK_TREE } else { 3 };
    let level = u8::from(flags & 32 != 0);
    let p = Ptr {
        page: FUZZ_PAGE,
        crc: if flags & FIX_CHECKSUMS != 0 {
            crc(&[stored])
        } else {
            u32_at(stored, 0).unwrap_or(0)
        },
        units: u16::try_from(stored.len() / UNIT).unwrap_or(u16::MAX),
        codec: (flags >> 2) & 3,
    };
    let crypto = if flags & ENCRYPTED != 0 {
        fuzz_crypto([0; 16])
    } else {
        None
    };
    let Ok(page) = page_cache::open_stored(stored, crypto.as_ref(), p, tree, level, 0) else {
        return false;
    };
    assert_eq!(page.len(), PAGE_BYTES, "a decoded page is one page long");
    let stride = page_cache::stride(tree, level);
    let (codec, again) = page_cache::encode_page(&page, stride);
    assert_eq!(
        page_cache::decode_page(codec, &again, stride).as_deref(),
        Some(&page[..]),
        "page encoding round trip"
    );
    if level > 0 {
        let mut out = vec![0u8; PAGE_BYTES];
        for i in 0..page_cache::FANOUT as usize {
            let ptr = Ptr::read(&page, i);
            ptr.write(&mut out, i);
            assert_eq!(Ptr::read(&out, i), ptr, "page pointer round trip");
        }
    } else if tree == CHUNK_TREE {
        let mut out = vec![0u8; PAGE_BYTES];
        for i in 0..format::CHUNKS_PER_PAGE {
            let slot = chunk_table::decode_slot(&page, i);
            chunk_table::encode_slot(&mut out, i, slot.as_ref());
            // A slot with an unknown codec reads as Raw (its record then fails the codec
            // check when read): only slots with a known codec round trip exactly.
            let known = format::ChunkCodec::from_u8(page[i * 32 + 27]).is_some();
            if known {
                assert_eq!(
                    chunk_table::decode_slot(&out, i),
                    slot,
                    "chunk table slot round trip"
                );
            }
        }
    } else {
        for w in page.chunks_exact(8) {
            let raw = u64::from_le_bytes(w.try_into().unwrap_or_default());
            let entry = condense_engine::block_map::decode(raw);
            assert_eq!(
                condense_engine::block_map::encode(entry),
                raw,
                "block map entry"
            );
        }
    }
    true
}

// ---------------------------------------------------------------------------------------------
// Segments and chunk records.

/// The records of a segment file as far as their headers chain: (id, offset).
fn record_ids(buf: &[u8]) -> Vec<u64> {
    let mut ids = Vec::new();
    let mut pos = format::SEGMENT_HEADER_BYTES;
    while let (Some(lo), Some(lc), Some(hi)) = (
        u32_at(buf, pos + 4),
        u32_at(buf, pos + 24),
        u32_at(buf, pos + 28),
    ) {
        ids.push(u64::from(lo) | u64::from(hi) << 32);
        pos += format::RECORD_HEADER_BYTES + (lc & format::STORED_LEN_MAX) as usize;
    }
    ids
}

fn fix_segment(buf: &mut [u8]) {
    let sh = format::SEGMENT_HEADER_BYTES;
    if buf.len() < sh {
        return;
    }
    let c = crc(&[&buf[..sh - 4]]);
    put_crc(buf, sh - 4, c);
    let mut pos = sh;
    while let Some(lc) = u32_at(buf, pos + 24) {
        let end = pos + format::RECORD_HEADER_BYTES + (lc & format::STORED_LEN_MAX) as usize;
        if end > buf.len() {
            break;
        }
        let c = crc(&[&buf[pos + 4..end]]);
        put_crc(buf, pos, c);
        pos = end;
    }
}

/// A segment file (flags byte, then the file): its header, then every record the repair scan
/// finds, each read back through the chunk read path (checked, opened in an encrypted pool,
/// decompressed into a 4 KiB block).
pub fn segment(data: &[u8]) -> bool {
    let Some((flags, rest)) = split(data) else {
        return false;
    };
    let mut buf = rest.to_vec();
    if flags & FIX_CHECKSUMS != 0 {
        fix_segment(&mut buf);
    }
    let uuid = uuid_at(&buf, 16);
    let Ok(id) = format::decode_segment_header(&buf, &uuid) else {
        return false;
    };
    let crypto = if flags & ENCRYPTED != 0 {
        fuzz_crypto(uuid)
    } else {
        None
    };
    let dir = SimHandle(SimDir::new());
    let Some(file) = sim_file(&dir, &format::segment_name(id), &buf) else {
        return false;
    };
    let mut segments = Segments::new(1 << 20, uuid);
    segments.add_existing(id, file, buf.len() as u64);
    let wanted: HashMap<u64, String> = record_ids(&buf)
        .into_iter()
        .map(|i| (i, String::new()))
        .collect();
    let found = condense_engine::repair::scan_segments(&segments, &wanted, &HashMap::new());
    let decoded = !found.is_empty();
    for (rid, (loc, fp)) in found {
        assert_eq!(loc.segment, id);
        let start = loc.offset as usize;
        let Some(rec) = buf.get(start..start + loc.record_bytes() as usize) else {
            panic!("the scan found a record past the end of its segment");
        };
        let payload = match format::decode_record(rec, rid, &loc) {
            Ok((f, payload)) => {
                assert_eq!(f, fp, "the scan and the decoder disagree on a fingerprint");
                payload
            }
            Err(e) => panic!("a record the scan found does not decode: {e}"),
        };
        let mut again = Vec::new();
        format::encode_record(&mut again, rid, &fp, loc.codec, payload);
        assert_eq!(again, rec, "chunk record round trip");
        let what = || format!("fuzzed chunk {rid}");
        if let Ok(opened) = format::open_record(rec, rid, &loc, crypto.as_ref(), Some(&fp), what) {
            let mut block = vec![0u8; 4096];
            let _ = condense_engine::reduction::decompress(loc.codec, &opened, &mut block, what);
        }
    }
    decoded
}

// ---------------------------------------------------------------------------------------------
// Delta records.

/// The block of base chunk `id` in the fuzzed delta records: noise seeded by the id, so a
/// seed's bases are known and a mutated id names another (wrong) base.
pub fn delta_base_block(id: u64) -> Vec<u8> {
    let mut s = id;
    (0..FUZZ_BLOCK)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let z = (s ^ (s >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            (z ^ (z >> 27)) as u8
        })
        .collect()
}

/// `delta_record`: the (opened) payload of a delta chunk record (docs/FORMAT.md "Delta
/// records"): parsed, encoded back to the same bytes, then decoded into a 4 KiB block
/// against its bases' blocks ([`delta_base_block`]) and against no bases at all.
pub fn delta_record(data: &[u8]) -> bool {
    use condense_engine::reduction::{decompress_delta, DeltaPayload, MAX_BASES};
    let Ok(p) = DeltaPayload::parse(data, String::new) else {
        return false;
    };
    assert!(!p.bases.is_empty() && p.bases.len() <= MAX_BASES);
    assert_eq!(p.encode(), data, "delta payload round trip");
    let dict: Vec<u8> = p.bases.iter().flat_map(|&b| delta_base_block(b)).collect();
    let mut block = vec![0u8; FUZZ_BLOCK as usize];
    let decoded = decompress_delta(p.compressed, &dict, &mut block, String::new).is_ok();
    let _ = decompress_delta(p.compressed, &[], &mut block, String::new);
    // The chunk read path refuses a delta decoded without its bases.
    assert!(condense_engine::reduction::decompress(
        format::ChunkCodec::ZstdDelta,
        data,
        &mut block,
        String::new
    )
    .is_err());
    decoded
}

// ---------------------------------------------------------------------------------------------
// The cache tier.

const FUZZ_BLOCK: u32 = 4096;

/// `cache.idx` (flags byte, slot count byte, then the records after the header). The index
/// is parsed, its entries encoded again and parsed back; then a cache is opened over it (with
/// an empty `cache.dat`) and asked for every chunk the index names.
pub fn cache_index(data: &[u8]) -> bool {
    let Some((flags, rest)) = split(data) else {
        return false;
    };
    let Some((slots_byte, body)) = split(rest) else {
        return false;
    };
    let slots = cache_tier::CACHE_SLOTS_MIN as u32 + u32::from(slots_byte);
    let slot_bytes = cache_tier::slot_bytes_for(FUZZ_BLOCK);
    let uuid = [0x11; 16];
    let mut buf = cache_tier::index_header(&uuid, slot_bytes, slots);
    buf.extend_from_slice(body);
    if flags & FIX_CHECKSUMS != 0 {
        for r in buf[cache_tier::CACHE_INDEX_HEADER_BYTES..].chunks_exact_mut(64) {
            let c = crc(&[&r[4..]]);
            put_crc(r, 0, c);
        }
    }
    let parsed = cache_tier::parse_index(&buf, slots);
    assert!(parsed.good_len <= buf.len().max(64) as u64);
    assert_eq!(
        parsed.good_len,
        64 + 64 * parsed.records,
        "good length counts whole records"
    );
    assert!(parsed.slots.keys().all(|&s| s < slots), "slot out of range");
    // Round trip: the entries and counters, logged again, parse to the same.
    let mut again = cache_tier::index_header(&uuid, slot_bytes, slots);
    for (&slot, &(id, fp, len, c)) in &parsed.slots {
        again.extend_from_slice(&cache_tier::insert_record(slot, id, &fp, len, c));
    }
    let mut counters = Vec::new();
    for c in parsed.counters {
        counters.extend_from_slice(&c.to_le_bytes());
    }
    again.extend_from_slice(&cache_tier::record(cache_tier::KIND_COUNTERS, &counters));
    let reparsed = cache_tier::parse_index(&again, slots);
    assert_eq!(reparsed.slots, parsed.slots, "cache index round trip");
    assert_eq!(
        reparsed.counters, parsed.counters,
        "cache counters round trip"
    );
    open_cache(&buf, &uuid, slots, &parsed.slots);
    parsed.records > 0
}

fn open_cache(
    index: &[u8],
    uuid: &[u8; 16],
    slots: u32,
    entries: &HashMap<u32, (u64, format::Fingerprint, u32, u32)>,
) {
    let slot_bytes = cache_tier::slot_bytes_for(FUZZ_BLOCK);
    let disk = SimDir::new();
    let dir = SimHandle(disk.clone());
    let data = cache_tier::data_header(uuid, slot_bytes, slots);
    if sim_file(&dir, cache_tier::CACHE_INDEX_NAME, index).is_none()
        || sim_file(&dir, cache_tier::CACHE_DATA_NAME, &data).is_none()
    {
        return;
    }
    let size = cache_tier::CACHE_DATA_HEADER_BYTES + u64::from(slots) * slot_bytes;
    let Ok(c) = ChunkCache::open(
        Arc::new(dir),
        size,
        CacheMode::WriteThrough,
        *uuid,
        FUZZ_BLOCK,
    ) else {
        return;
    };
    for &(id, fp, len, _) in entries.values() {
        let loc = Location {
            segment: 0,
            offset: 0,
            stored_len: len.saturating_sub(format::RECORD_HEADER_BYTES as u32)
                & format::STORED_LEN_MAX,
            codec: format::ChunkCodec::Raw,
        };
        if let Some(rec) = c.lookup(id, &fp, &loc) {
            assert!(
                format::decode_record(&rec, id, &loc).is_ok(),
                "cache served a bad record"
            );
        }
    }
    let _ = c.close();
}

/// The text files are read line by line, a line ending in `\n` or `\r\n`, so a value ending
/// in `\r` (read from a line ending in `\r\r\n`, or a last line ending in `\r`) is written
/// back as a line ending in `\r\n` and read back without it: it does not round trip,
/// harmlessly (nothing writes such a value). True when the round trip is to be checked: the
/// encoder, which writes no `\r` of its own, wrote none before a newline.
fn round_trips(encoded: &[u8]) -> bool {
    !encoded.windows(2).any(|w| w == b"\r\n")
}

/// `cache.conf`: decodes, and what decodes encodes and decodes back to itself.
pub fn cache_conf(data: &[u8]) -> bool {
    let Ok(conf) = CacheConf::decode(data) else {
        return false;
    };
    if !round_trips(conf.encode().as_bytes()) {
        return true;
    }
    match CacheConf::decode(conf.encode().as_bytes()) {
        Ok(again) => assert_eq!(again, conf, "cache.conf round trip"),
        Err(e) => panic!("an encoded cache.conf does not decode: {e}"),
    }
    true
}

/// `dedup.idx`, the dedup index saved at a clean close: loaded against the stamp its own
/// header names (so inputs get past that check), it must load or be refused; what loads
/// answers lookups without panicking or looping (every probe meets an empty slot).
pub fn dedup_index(data: &[u8]) -> bool {
    use condense_engine::format::dedup_index::{BODY_CRC_AT, DEDUP_INDEX_HEADER_BYTES};
    let Some((flags, rest)) = split(data) else {
        return false;
    };
    let mut buf = rest.to_vec();
    if flags & FIX_CHECKSUMS != 0 && buf.len() >= DEDUP_INDEX_HEADER_BYTES {
        // The body's CRC over everything after the header (and the header's shard count
        // taken as written), then the header's own.
        let body = crc(&[&buf[DEDUP_INDEX_HEADER_BYTES..]]);
        put_crc(&mut buf, BODY_CRC_AT, body);
        let head = crc(&[&buf[..DEDUP_INDEX_HEADER_BYTES - 4]]);
        put_crc(&mut buf, DEDUP_INDEX_HEADER_BYTES - 4, head);
    }
    let Ok(h) = condense_engine::format::dedup_index::decode_dedup_index_header(&buf) else {
        return false;
    };
    let dir = SimHandle(SimDir::new());
    let Ok(file) = dir.open(format::dedup_index::DEDUP_INDEX_NAME, true) else {
        return false;
    };
    if file.write_at(&buf, 0).is_err() {
        return false;
    }
    let Ok(mut ix) = condense_engine::dedup_index::DedupIndex::load(&*file, h.uuid, h.stamp) else {
        return false;
    };
    // Lookups, inserts (which may grow a shard) and removals on what loaded.
    let mut out = Vec::new();
    for i in 0..64u8 {
        let fp = [i; 16];
        ix.candidates(&fp, &mut out);
        ix.insert(&fp, u64::from(i));
        ix.remove(&fp, u64::from(i));
    }
    true
}

// ---------------------------------------------------------------------------------------------
// Pools on S3: remote.conf, the lease, write-ahead objects.

/// `remote.conf` in a pool's local directory.
pub fn remote_conf(data: &[u8]) -> bool {
    let Ok(conf) = RemoteConf::decode(data) else {
        return false;
    };
    if !round_trips(conf.encode().as_bytes()) {
        return true;
    }
    match RemoteConf::decode(conf.encode().as_bytes()) {
        Ok(again) => assert_eq!(again, conf, "remote.conf round trip"),
        Err(e) => panic!("an encoded remote.conf does not decode: {e}"),
    }
    let _ = remote::parse_s3_url(&conf.url);
    true
}

/// The `lease` object of a bucket.
pub fn lease(data: &[u8]) -> bool {
    let Some(l) = remote::LeaseBody::decode(data) else {
        return false;
    };
    let encoded = l.encode();
    if !round_trips(&encoded) {
        return true;
    }
    match remote::LeaseBody::decode(&encoded) {
        Some(again) => assert_eq!(again.encode(), encoded, "lease round trip"),
        None => panic!("an encoded lease does not decode"),
    }
    true
}

/// A checkpoint root's manifest (`gen/E-W/manifest.SEQ`) of a bucket, and object names:
/// every name parses without panic, a parsed name written again parses to the same thing,
/// and an encoded manifest decodes to itself.
pub fn manifest(data: &[u8]) -> bool {
    use condense_engine::format::bucket::{
        claim_object, gen_object, manifest_object, parse_object, valid_object_name, wal_object,
        Generation, Manifest, ObjectKind,
    };
    if let Ok(text) = std::str::from_utf8(data) {
        for line in text.lines() {
            let Some(kind) = parse_object(line) else {
                continue;
            };
            let again = match &kind {
                ObjectKind::File { gen, name, seq } if *gen != Generation::LEGACY => {
                    gen_object(*gen, name, *seq)
                }
                ObjectKind::Manifest { gen, seq } => manifest_object(*gen, *seq),
                ObjectKind::Wal { gen, seq } if *gen != Generation::LEGACY => {
                    wal_object(*gen, *seq)
                }
                ObjectKind::Claim { gen, renewal } => claim_object(*gen, *renewal),
                _ => continue,
            };
            assert_eq!(
                parse_object(&again),
                Some(kind),
                "{line:?} written as {again:?}"
            );
        }
    }
    let Ok(m) = Manifest::decode("fuzz", data) else {
        return false;
    };
    for (name, (obj, _)) in &m.files {
        assert!(valid_object_name(name) && valid_object_name(obj));
    }
    assert_eq!(
        Manifest::decode("fuzz", &m.encode()).ok().as_ref(),
        Some(&m),
        "manifest round trip"
    );
    true
}

/// A write-ahead object (`wal/SEQ`) of a bucket.
pub fn wal_object(data: &[u8]) -> bool {
    let Some((name, offset, bytes)) = remote::decode_wal(data) else {
        return false;
    };
    assert!(
        !name.contains('/') && !name.starts_with('.'),
        "unsafe file name {name:?}"
    );
    let encoded = remote::encode_wal(&name, offset, bytes);
    assert_eq!(
        remote::decode_wal(&encoded),
        Some((name.clone(), offset, bytes)),
        "write-ahead object round trip"
    );
    true
}

// ---------------------------------------------------------------------------------------------
// Sealed objects and key files.

const KINDS: [Kind; 5] = [
    Kind::Chunk,
    Kind::Page,
    Kind::JournalBatch,
    Kind::Root,
    Kind::DataKey,
];

/// A sealed object (kind byte, context length byte, context, then the sealed bytes) opened
/// with the fuzz key: a hostile blob is an authentication error, never a panic; what opens
/// was sealed by that key and context, and seals and opens again; any changed byte of it,
/// or another kind, fails.
pub fn sealed_object(data: &[u8]) -> bool {
    let (Some(&k), Some(&n)) = (data.first(), data.get(1)) else {
        return false;
    };
    let kind = KINDS[usize::from(k) % KINDS.len()];
    let n = usize::from(n) % 25; // up to 24: a context longer than any object's is an error
    let Some(ctx) = data.get(2..2 + n) else {
        return false;
    };
    let sealed = &data[2 + n..];
    let uuid = [0x33; 16];
    let Some(c) = fuzz_crypto(uuid) else {
        return false;
    };
    let Ok(plain) = c.open(kind, ctx, sealed, String::new) else {
        return false;
    };
    let other = KINDS[(usize::from(k) + 1) % KINDS.len()];
    assert!(
        c.open(other, ctx, sealed, String::new).is_err(),
        "opened as another kind"
    );
    for i in [0, sealed.len() / 2, sealed.len() - 1] {
        let mut t = sealed.to_vec();
        t[i] ^= 0x80;
        assert!(
            c.open(kind, ctx, &t, String::new).is_err(),
            "changed byte {i} opened"
        );
    }
    match c.sealed(kind, ctx, &plain) {
        Ok(again) => match c.open(kind, ctx, &again, String::new) {
            Ok(p) => assert_eq!(p, plain, "seal/open round trip"),
            Err(e) => panic!("a sealed object does not open: {e}"),
        },
        Err(e) => panic!("an opened object does not seal again: {e}"),
    }
    true
}

/// A key file's contents.
pub fn key_file(data: &[u8]) -> bool {
    let Ok(UserKey::Key(k)) = UserKey::from_key_file_bytes(data) else {
        return false;
    };
    if data.len() == 32 {
        assert_eq!(&k[..], data, "a raw key file is the key");
    }
    true
}

// ---------------------------------------------------------------------------------------------
// The seed corpus.

/// Write the seed corpus of every target above into `root/TARGET/` (one file per seed): real
/// encodings made by a pool on the simulated disk and by the encoders, sealed with the fuzz
/// key where encrypted. Returns the number of seeds written.
pub fn write_seeds(root: &std::path::Path) -> condense_engine::Result<usize> {
    seeds::write(root)
}

mod seeds;
