//! Data reduction of one block: zero detection, fingerprinting, compression.
//!
//! Pure functions of bytes, shared by the write path and by `condense estimate`, so that an
//! estimate projects exactly what the engine stores. A compressed chunk is kept only when it
//! saves at least 1/8 of the block; otherwise it is stored raw.

use crate::error::{Error, Result};
use crate::{ChunkCodec, Compression, Fingerprint};

/// True if every byte is zero. ORs 64-byte runs (which the compiler vectorises) and stops at
/// the first non-zero run.
pub fn is_zero(block: &[u8]) -> bool {
    let runs = block.chunks_exact(64);
    let tail = runs.remainder();
    runs.into_iter()
        .all(|c| c.iter().fold(0u8, |a, &b| a | b) == 0)
        && tail.iter().all(|&b| b == 0)
}

/// Keyed BLAKE3-256 of a block, truncated to the 128 bits the pool keeps.
pub fn fingerprint(key: &[u8; 32], block: &[u8]) -> Fingerprint {
    let h = blake3::keyed_hash(key, block);
    let mut fp = [0u8; 16];
    fp.copy_from_slice(&h.as_bytes()[..16]);
    fp
}

/// Blocks hashed side by side by [`classify`]: AVX-512's 16 lanes (AVX2 uses 8 of them).
const HASH_LANES: usize = 16;
/// Chunks of a block [`classify`] hashes side by side: blocks of 4 and 8 KiB. BLAKE3 hashes
/// the chunks of one larger block in parallel at full width by itself.
const MAX_LANE_CHUNKS: usize = 8;

/// For each block of `data` (whole blocks of `bs` bytes): `None` if it is all zeros, else its
/// [`fingerprint`]. Equal to calling those two per block, but small blocks are hashed
/// [`HASH_LANES`] at a time: one 4 KiB block is only 4 BLAKE3 chunks, so hashed alone it fills
/// a quarter of an AVX-512 register and runs at half the speed of a long input (measured here:
/// 2.4 against 4.7 GB/s per core).
///
/// This uses `blake3::platform`, the crate's undocumented SIMD entry point; the crate's version
/// is pinned in Cargo.toml, and `classify_equals_fingerprint_per_block` checks every block size
/// against [`blake3::keyed_hash`].
pub fn classify(key: &[u8; 32], data: &[u8], bs: usize) -> Vec<Option<Fingerprint>> {
    let chunks = bs / blake3::CHUNK_LEN;
    let mut out: Vec<Option<Fingerprint>> = Vec::with_capacity(data.len() / bs);
    if !(2..=MAX_LANE_CHUNKS).contains(&chunks)
        || !chunks.is_power_of_two()
        || !bs.is_multiple_of(blake3::CHUNK_LEN)
    {
        out.extend(data.chunks_exact(bs).map(|b| {
            if is_zero(b) {
                None
            } else {
                Some(fingerprint(key, b))
            }
        }));
        return out;
    }
    let mut lanes: Vec<(usize, &[u8])> = Vec::with_capacity(HASH_LANES);
    for (i, b) in data.chunks_exact(bs).enumerate() {
        if is_zero(b) {
            out.push(None);
            continue;
        }
        out.push(None); // filled in when its group of lanes is hashed
        lanes.push((i, b));
        if lanes.len() == HASH_LANES {
            hash_lanes(key, &lanes, chunks, &mut out);
            lanes.clear();
        }
    }
    // Fewer blocks than a block has chunks: BLAKE3 alone hashes each block's chunks side by
    // side, wider than the lanes would be.
    if lanes.len() < chunks {
        for &(i, b) in &lanes {
            out[i] = Some(fingerprint(key, b));
        }
    } else if !lanes.is_empty() {
        hash_lanes(key, &lanes, chunks, &mut out);
    }
    out
}

/// BLAKE3's domain flags (from the BLAKE3 specification, section 2.1).
const CHUNK_START: u8 = 1;
const CHUNK_END: u8 = 1 << 1;
const PARENT: u8 = 1 << 2;
const ROOT: u8 = 1 << 3;
const KEYED_HASH: u8 = 1 << 4;

/// Keyed BLAKE3 of up to [`HASH_LANES`] blocks of `chunks` chunks each (a power of two, at
/// most [`MAX_LANE_CHUNKS`]), written to `out[i]` for each `(i, block)`. Each tree level is
/// one SIMD call over every block: first chunk `c` of every block (all at counter `c`), then
/// the parents, pairwise, up to the roots.
fn hash_lanes(
    key: &[u8; 32],
    lanes: &[(usize, &[u8])],
    chunks: usize,
    out: &mut [Option<Fingerprint>],
) {
    use blake3::platform::{words_from_le_bytes_32, Platform};
    use blake3::{IncrementCounter, CHUNK_LEN, OUT_LEN};
    debug_assert!(chunks.is_power_of_two() && chunks <= MAX_LANE_CHUNKS);
    debug_assert!(lanes.len() <= HASH_LANES);
    let platform = Platform::detect();
    let key_words = words_from_le_bytes_32(key);
    let n = lanes.len();
    // Chaining values, lane-major: cvs[lane * chunks + node] (each level overwrites the front).
    let mut cvs = [[0u8; OUT_LEN]; HASH_LANES * MAX_LANE_CHUNKS];
    let mut hashed = [0u8; OUT_LEN * HASH_LANES * MAX_LANE_CHUNKS / 2];
    for c in 0..chunks {
        let mut inputs: [&[u8; CHUNK_LEN]; HASH_LANES] = [&[0; CHUNK_LEN]; HASH_LANES];
        for (slot, (_, block)) in inputs.iter_mut().zip(lanes) {
            // A block is `chunks` whole chunks (checked by `classify`).
            *slot = &block.as_chunks::<CHUNK_LEN>().0[c];
        }
        let out = &mut hashed[..n * OUT_LEN];
        platform.hash_many(
            &inputs[..n],
            &key_words,
            c as u64,
            IncrementCounter::No,
            KEYED_HASH,
            CHUNK_START,
            CHUNK_END,
            out,
        );
        for (lane, cv) in out.chunks_exact(OUT_LEN).enumerate() {
            cvs[lane * chunks + c].copy_from_slice(cv);
        }
    }
    let mut width = chunks;
    while width > 1 {
        let half = width / 2;
        let mut parents = [[0u8; 2 * OUT_LEN]; HASH_LANES * MAX_LANE_CHUNKS / 2];
        for lane in 0..n {
            for p in 0..half {
                let node = &mut parents[lane * half + p];
                node[..OUT_LEN].copy_from_slice(&cvs[lane * chunks + 2 * p]);
                node[OUT_LEN..].copy_from_slice(&cvs[lane * chunks + 2 * p + 1]);
            }
        }
        let inputs: [&[u8; 2 * OUT_LEN]; HASH_LANES * MAX_LANE_CHUNKS / 2] =
            std::array::from_fn(|k| &parents[k]);
        let flags = KEYED_HASH | PARENT | if half == 1 { ROOT } else { 0 };
        let out = &mut hashed[..n * half * OUT_LEN];
        platform.hash_many(
            &inputs[..n * half],
            &key_words,
            0,
            IncrementCounter::No,
            flags,
            0,
            0,
            out,
        );
        for (k, cv) in out.chunks_exact(OUT_LEN).enumerate() {
            cvs[(k / half) * chunks + k % half].copy_from_slice(cv);
        }
        width = half;
    }
    for (lane, &(i, _)) in lanes.iter().enumerate() {
        let mut fp = [0u8; 16];
        fp.copy_from_slice(&cvs[lane * chunks][..16]);
        out[i] = Some(fp);
    }
}

/// Compress one block under the pool's setting; returns the codec actually used and the bytes
/// to store (raw when compression would save less than 1/8).
pub fn compress(compression: Compression, block: &[u8]) -> (ChunkCodec, Vec<u8>) {
    try_compress(compression, block).unwrap_or_else(|| (ChunkCodec::Raw, block.to_vec()))
}

/// The compressed form of one block, if it saves at least 1/8 (else the block is stored raw:
/// callers then use the block itself, with no copy).
pub fn try_compress(compression: Compression, block: &[u8]) -> Option<(ChunkCodec, Vec<u8>)> {
    let limit = block.len() - block.len() / 8;
    let attempt = match compression {
        Compression::None => None,
        Compression::Lz4 => lz4_into_scratch(block, limit).map(|c| (ChunkCodec::Lz4, c)),
        Compression::Zstd(level) => {
            zstd_compress(block, None, i32::from(level)).map(|c| (ChunkCodec::Zstd, c))
        }
    };
    attempt.filter(|(_, c)| c.len() <= limit)
}

/// Incompressible blocks in a row after which [`Compressor`] stops trying every block.
const SKIP_AFTER: u32 = 8;
/// In such a run, one block in this many is still tried.
const TRY_EVERY: u32 = 16;
/// In such a run, a block is tried anyway if a sample of it (every 17th byte: a stride that
/// is no multiple of a word, so it sees every byte of them) holds fewer distinct byte values
/// than this. Random bytes give ~156 of 241 samples (rarely under 140); text, code and
/// tables far fewer.
const GUARD_DISTINCT: u32 = 130;

/// [`try_compress`] over the new chunks of one write, in order, giving up early on
/// incompressible data: after [`SKIP_AFTER`] incompressible blocks in a row it tries only
/// one block in [`TRY_EVERY`], and those whose byte sample looks like anything but noise;
/// any block that compresses makes it try every block again. (OpenZFS gives up on LZ4 early
/// in a block; here it is the run of blocks: a 4 KiB block of noise already costs LZ4 ~0.9 µs,
/// an eighth of `serve`'s CPU under 1 MiB writes of random data.)
///
/// Simulated over the ten corpus images in 1 MiB writes: 67 % of the LZ4 calls on
/// incompressible blocks skipped, 0.004 % of LZ4's savings lost. `condense estimate`
/// tries every block, so it may project that much more savings than a write stores.
#[derive(Default)]
pub struct Compressor {
    /// Incompressible blocks tried in a row.
    run: u32,
    /// Blocks skipped since the last one tried.
    skipped: u32,
}

impl Compressor {
    /// Like [`try_compress`], but may skip a block in a run of incompressible ones (`None`:
    /// store it raw).
    pub fn try_compress(
        &mut self,
        compression: Compression,
        block: &[u8],
    ) -> Option<(ChunkCodec, Vec<u8>)> {
        if compression == Compression::None {
            return None;
        }
        let tried = self.run < SKIP_AFTER
            || self.skipped + 1 >= TRY_EVERY
            || sampled_distinct_bytes(block) < GUARD_DISTINCT;
        if !tried {
            self.skipped += 1;
            return None;
        }
        self.skipped = 0;
        let got = try_compress(compression, block);
        self.run = if got.is_some() { 0 } else { self.run + 1 };
        got
    }
}

/// How many distinct byte values ~241 bytes spread over `block` hold (every 17th byte of a
/// 4 KiB block; an odd stride, so every byte of a word is sampled). One byte per value, so
/// the stores do not wait on each other as bits in a word would.
fn sampled_distinct_bytes(block: &[u8]) -> u32 {
    let stride = (block.len() / 241).max(17) | 1;
    let mut seen = [0u8; 256];
    for &b in block.iter().step_by(stride) {
        seen[usize::from(b)] = 1;
    }
    seen.iter().map(|&s| u32::from(s)).sum()
}

/// How many of a write's `misses` new chunks each [`Compressor`] takes, in order (one run each,
/// so each starts trying every block): all of them, or with `spread` over `threads` threads
/// four runs per thread, long enough to skip noise. The write path's split (engine
/// `pool/write.rs`), which `condense estimate --delta` follows to size each block alone.
pub fn compressor_run(misses: usize, threads: usize, spread: bool) -> usize {
    if spread && misses >= 16 {
        misses.div_ceil(4 * threads.max(1)).max(8)
    } else {
        misses.max(1)
    }
}

thread_local! {
    /// LZ4's worst-case output buffer, kept per thread: `lz4_flex::block::compress` allocates
    /// and zeroes a fresh one for every block, which cost as much as a fifth of the LZ4 time.
    static LZ4_SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// LZ4 of `block`, if it fits in `limit` bytes (only those bytes are copied out).
fn lz4_into_scratch(block: &[u8], limit: usize) -> Option<Vec<u8>> {
    LZ4_SCRATCH.with(|scratch| {
        let mut out = scratch.borrow_mut();
        let need = lz4_flex::block::get_maximum_output_size(block.len());
        if out.len() < need {
            out.resize(need, 0);
        }
        match lz4_flex::block::compress_into(block, &mut out) {
            Ok(n) if n <= limit => Some(out[..n].to_vec()),
            _ => None,
        }
    })
}

/// Decode a stored payload into `out` (exactly one block).
pub fn decompress(
    codec: ChunkCodec,
    payload: &[u8],
    out: &mut [u8],
    what: impl Fn() -> String,
) -> Result<()> {
    let n = match codec {
        ChunkCodec::Raw => {
            if payload.len() != out.len() {
                return Err(Error::corrupt(what(), "raw chunk of the wrong length"));
            }
            out.copy_from_slice(payload);
            out.len()
        }
        ChunkCodec::Lz4 => lz4_flex::block::decompress_into(payload, out)
            .map_err(|e| Error::corrupt(what(), format!("lz4: {e}")))?,
        ChunkCodec::Zstd => zstd_decompress(payload, None, out)
            .map_err(|e| Error::corrupt(what(), format!("zstd: {e}")))?,
        ChunkCodec::ZstdDelta => {
            return Err(Error::corrupt(
                what(),
                "a delta record decoded without its bases (a bug: use decompress_delta)",
            ))
        }
    };
    if n != out.len() {
        return Err(Error::corrupt(
            what(),
            format!("decompressed to {n} bytes, expected {}", out.len()),
        ));
    }
    Ok(())
}

/// Most bases a delta names.
pub const MAX_BASES: usize = crate::common::MAX_DELTA_BASES;

/// A delta record's payload (docs/FORMAT.md "Delta records"): base count (u8, 1 or 2), each
/// base's chunk id (u64 LE), then the block compressed with zstd against the bases' blocks,
/// concatenated in that order, as a raw-content dictionary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeltaPayload<'a> {
    pub bases: Vec<u64>,
    pub compressed: &'a [u8],
}

impl<'a> DeltaPayload<'a> {
    /// Parse a payload read from disk (checked: never panics, whatever the bytes).
    pub fn parse(payload: &'a [u8], what: impl Fn() -> String) -> Result<DeltaPayload<'a>> {
        let bad = |why: &str| Error::corrupt(what(), format!("delta record: {why}"));
        let (&n, rest) = payload.split_first().ok_or_else(|| bad("empty payload"))?;
        let n = usize::from(n);
        if n == 0 || n > MAX_BASES {
            return Err(bad(&format!("{n} bases (1 or {MAX_BASES} expected)")));
        }
        let ids = rest.get(..8 * n).ok_or_else(|| bad("truncated base ids"))?;
        let bases = ids
            .chunks_exact(8)
            .map(|c| {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                u64::from_le_bytes(b)
            })
            .collect();
        Ok(DeltaPayload {
            bases,
            compressed: &rest[8 * n..],
        })
    }

    /// The payload's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + 8 * self.bases.len() + self.compressed.len());
        out.push(self.bases.len() as u8);
        for b in &self.bases {
            out.extend_from_slice(&b.to_le_bytes());
        }
        out.extend_from_slice(self.compressed);
        out
    }
}

/// True if `block` may be (the first) base: zstd would take a dictionary starting with its
/// dictionary magic for a trained one, so such a block never is.
pub fn may_be_base(block: &[u8]) -> bool {
    block.get(..4) != Some(&zstd::zstd_safe::MAGIC_DICTIONARY.to_le_bytes()[..])
}

thread_local! {
    /// zstd's compression and decompression contexts, kept per thread. A fresh context for
    /// every 4 KiB block (what `zstd::bulk` does) cost 28 µs per delta tried against 7.7 µs
    /// reused, and 9.4 µs per delta read against 1.7 µs (bench/README.md "zstd contexts").
    /// Each call sets every parameter, so what a call produces does not depend on the calls
    /// before it on the same thread.
    static ZSTD_CTX: std::cell::RefCell<(zstd::zstd_safe::CCtx<'static>, zstd::zstd_safe::DCtx<'static>)> =
        std::cell::RefCell::new((zstd::zstd_safe::CCtx::create(), zstd::zstd_safe::DCtx::create()));
}

/// `block` compressed with zstd at `level`, against `dict` as raw content if given (the
/// thread's context); `None` if zstd failed.
fn zstd_compress(block: &[u8], dict: Option<&[u8]>, level: i32) -> Option<Vec<u8>> {
    let mut out: Vec<u8> = Vec::with_capacity(zstd::zstd_safe::compress_bound(block.len()));
    ZSTD_CTX
        .with(|ctx| {
            let cctx = &mut ctx.borrow_mut().0;
            match dict {
                Some(dict) => cctx.compress_using_dict(&mut out, block, dict, level),
                None => cctx.compress(&mut out, block, level),
            }
        })
        .ok()?;
    Some(out)
}

/// A zstd frame decoded into `out`, against `dict` as raw content if given (the thread's
/// context): the bytes written, or zstd's error by name.
fn zstd_decompress(
    frame: &[u8],
    dict: Option<&[u8]>,
    out: &mut [u8],
) -> std::result::Result<usize, &'static str> {
    ZSTD_CTX
        .with(|ctx| {
            let dctx = &mut ctx.borrow_mut().1;
            match dict {
                Some(dict) => dctx.decompress_using_dict(out, frame, dict),
                None => dctx.decompress(out, frame),
            }
        })
        .map_err(zstd::zstd_safe::get_error_name)
}

/// `block` compressed with zstd at `level` against `dict` (the bases' blocks, concatenated)
/// as raw content; `None` if zstd failed.
pub fn compress_delta(block: &[u8], dict: &[u8], level: i32) -> Option<Vec<u8>> {
    zstd_compress(block, Some(dict), level)
}

/// Delta bytes made ahead for some tries of one block, by their bases' ids: the same block,
/// bases and level always give the same bytes, so a search may make them side by side on
/// other threads and [`best_delta`] then only looks them up.
pub type DeltaMemo = std::collections::HashMap<Vec<u64>, Vec<u8>>;

/// The tries of a block against `bases` (id, block): each usable base alone, then the first
/// two together (their blocks in that order make the dictionary).
pub fn delta_tries<'b>(bases: &[(u64, &'b [u8])]) -> Vec<(Vec<u64>, Vec<&'b [u8]>)> {
    let usable: Vec<&(u64, &[u8])> = bases.iter().filter(|(_, b)| may_be_base(b)).collect();
    let mut tries: Vec<(Vec<u64>, Vec<&[u8]>)> =
        usable.iter().map(|(id, b)| (vec![*id], vec![*b])).collect();
    if let [(a, x), (b, y), ..] = usable[..] {
        tries.push((vec![*a, *b], vec![*x, *y]));
    }
    tries
}

/// The smallest delta payload of `block` over its [`delta_tries`] against `bases`, with its
/// bases' ids (the bytes of a try found in `memo` are not made again); `None` unless it is
/// at most `limit` bytes.
pub fn best_delta(
    block: &[u8],
    bases: &[(u64, &[u8])],
    level: i32,
    limit: usize,
    memo: &DeltaMemo,
) -> Option<(Vec<u64>, Vec<u8>)> {
    delta_tries(bases)
        .into_iter()
        .filter_map(|(ids, dict)| {
            let made;
            let compressed = match memo.get(&ids) {
                Some(c) => c,
                None => {
                    made = compress_delta(block, &dict.concat(), level)?;
                    &made
                }
            };
            let payload = DeltaPayload {
                bases: ids.clone(),
                compressed,
            }
            .encode();
            Some((ids, payload))
        })
        .min_by_key(|(_, p)| p.len())
        .filter(|(_, p)| p.len() <= limit)
}

/// Decode a delta's compressed bytes against `dict` (its bases' blocks, concatenated in the
/// payload's order) into `out` (exactly one block).
pub fn decompress_delta(
    compressed: &[u8],
    dict: &[u8],
    out: &mut [u8],
    what: impl Fn() -> String,
) -> Result<()> {
    let n = zstd_decompress(compressed, Some(dict), out)
        .map_err(|e| Error::corrupt(what(), format!("zstd delta: {e}")))?;
    if n != out.len() {
        return Err(Error::corrupt(
            what(),
            format!("delta decompressed to {n} bytes, expected {}", out.len()),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The thread's reused zstd contexts give exactly what fresh ones give, whatever came
    /// before on the thread: a dictionary, a damaged frame, another level.
    #[test]
    fn reused_zstd_contexts_match_fresh_ones() {
        let mut rng = TestRng::new(7);
        let words: Vec<u8> = (0..4096)
            .map(|_| b"abcdefgh \n"[rng.next_u64() as usize % 10])
            .collect();
        let mut similar = words.clone();
        for _ in 0..30 {
            similar[rng.next_u64() as usize % 4096] = rng.next_u64() as u8;
        }
        let fresh = |block: &[u8], dict: Option<&[u8]>, level: i32| {
            let mut c = zstd::zstd_safe::CCtx::create();
            let mut out = Vec::with_capacity(zstd::zstd_safe::compress_bound(block.len()));
            match dict {
                Some(d) => c.compress_using_dict(&mut out, block, d, level),
                None => c.compress(&mut out, block, level),
            }
            .expect("fresh zstd");
            out
        };
        for round in 0..3 {
            let delta = compress_delta(&similar, &words, 3).expect("delta");
            assert_eq!(delta, fresh(&similar, Some(&words), 3), "round {round}");
            let plain = zstd_compress(&similar, None, 1 + round).expect("plain");
            assert_eq!(plain, fresh(&similar, None, 1 + round), "round {round}");
            // A damaged frame fails and leaves the context usable.
            let mut out = vec![0u8; 4096];
            let mut bad = plain.clone();
            bad.truncate(bad.len() / 2);
            assert!(decompress(ChunkCodec::Zstd, &bad, &mut out, String::new).is_err());
            decompress_delta(&delta, &words, &mut out, String::new).expect("delta decodes");
            assert_eq!(out, similar);
            decompress(ChunkCodec::Zstd, &plain, &mut out, String::new).expect("plain decodes");
            assert_eq!(out, similar);
        }
    }

    #[test]
    fn damaged_or_truncated_delta_payloads_never_panic() {
        let mut rng = TestRng::new(44);
        let base: Vec<u8> = (0..4096).map(|_| rng.next_u64() as u8).collect();
        let mut block = base.clone();
        block[10..50].fill(7);
        let c = compress_delta(&block, &base, 3).expect("compress");
        let payload = DeltaPayload {
            bases: vec![5],
            compressed: &c,
        }
        .encode();
        assert!(
            payload.len() < 1024,
            "a near copy is small: {}",
            payload.len()
        );
        let p = DeltaPayload::parse(&payload, String::new).expect("parse");
        assert_eq!(p.bases, vec![5]);
        let mut out = vec![0u8; 4096];
        decompress_delta(p.compressed, &base, &mut out, String::new).expect("decode");
        assert_eq!(out, block);
        // Every truncation and many damaged copies: an error or some block, never a panic.
        for len in 0..payload.len() {
            if let Ok(p) = DeltaPayload::parse(&payload[..len], String::new) {
                let _ = decompress_delta(p.compressed, &base, &mut out, String::new);
            }
        }
        for _ in 0..2000 {
            let mut d = payload.clone();
            for _ in 0..1 + rng.next_u64() % 4 {
                let i = (rng.next_u64() % d.len() as u64) as usize;
                d[i] ^= 1 << (rng.next_u64() % 8);
            }
            if let Ok(p) = DeltaPayload::parse(&d, String::new) {
                assert!(p.bases.len() <= MAX_BASES);
                let _ = decompress_delta(p.compressed, &base, &mut out, String::new);
                let _ = decompress_delta(p.compressed, &[], &mut out, String::new);
            }
        }
        // The best of two bases alone and together: a block of half of each takes both.
        let other: Vec<u8> = (0..4096).map(|_| rng.next_u64() as u8).collect();
        let mut halves = base[..2048].to_vec();
        halves.extend_from_slice(&other[2048..]);
        let none = DeltaMemo::new();
        let both = [(5, &base[..]), (6, &other[..])];
        let (ids, p) = best_delta(&halves, &both, 3, 4096, &none).expect("a delta");
        assert_eq!(ids, vec![5, 6]);
        assert!(p.len() < 512, "{}", p.len());
        // Tries made ahead give the same choice and bytes; a memo's bytes are taken as they are.
        let memo: DeltaMemo = delta_tries(&both)
            .into_iter()
            .map(|(ids, d)| (ids, compress_delta(&halves, &d.concat(), 3).expect("try")))
            .collect();
        assert_eq!(memo.len(), 3, "two alone, one together");
        assert_eq!(best_delta(&halves, &both, 3, 4096, &memo), Some((ids, p)));
        let fake = DeltaMemo::from([(vec![6], vec![1u8])]);
        let picked = best_delta(&halves, &both, 3, 4096, &fake).map(|(ids, _)| ids);
        assert_eq!(
            picked,
            Some(vec![6]),
            "the memo's bytes were used, not made again"
        );
        let (ids, _) =
            best_delta(&block, &[(6, &other), (5, &base)], 3, 4096, &none).expect("a delta");
        assert_eq!(ids, vec![5], "the near copy's own base");
        assert!(
            best_delta(&block, &[(6, &other)], 3, 3584, &none).is_none(),
            "saves nothing"
        );
        assert!(DeltaPayload::parse(&[0], String::new).is_err());
        assert!(DeltaPayload::parse(&[3; 40], String::new).is_err());
        assert!(decompress(ChunkCodec::ZstdDelta, &payload, &mut out, String::new).is_err());
    }

    /// A seeded pseudo-random stream (splitmix64) for test data.
    struct TestRng(u64);

    impl TestRng {
        fn new(seed: u64) -> TestRng {
            TestRng(seed)
        }

        fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
    }

    #[test]
    fn zero_detection() {
        let mut b = vec![0u8; 4096];
        assert!(is_zero(&b));
        b[4095] = 1;
        assert!(!is_zero(&b));
        b[4095] = 0;
        b[17] = 1;
        assert!(!is_zero(&b));
    }

    #[test]
    fn classify_equals_fingerprint_per_block() {
        let mut rng = TestRng::new(7);
        let key: [u8; 32] = std::array::from_fn(|_| rng.next_u64() as u8);
        for bs in [4096usize, 8192, 16384, 65536] {
            // Counts around the lane width, with zero blocks mixed in at random.
            for count in [1usize, 2, 15, 16, 17, 33, 40] {
                let mut data: Vec<u8> = (0..bs * count).map(|_| rng.next_u64() as u8).collect();
                for b in data.chunks_exact_mut(bs) {
                    if rng.next_u64().is_multiple_of(4) {
                        b.fill(0);
                    }
                }
                let want: Vec<Option<Fingerprint>> = data
                    .chunks_exact(bs)
                    .map(|b| (!is_zero(b)).then(|| fingerprint(&key, b)))
                    .collect();
                assert_eq!(classify(&key, &data, bs), want, "bs {bs}, {count} blocks");
            }
        }
    }

    #[test]
    fn compressor_skips_runs_of_noise_but_not_what_compresses() {
        let mut rng = TestRng::new(3);
        let noise =
            |rng: &mut TestRng| -> Vec<u8> { (0..4096).map(|_| rng.next_u64() as u8).collect() };
        let mut c = Compressor::default();
        let mut tried = 0;
        for _ in 0..160 {
            let block = noise(&mut rng);
            assert!(c.try_compress(Compression::Lz4, &block).is_none());
            tried += usize::from(c.skipped == 0);
        }
        // The first SKIP_AFTER, then one in TRY_EVERY (a noise sample may pass the guard).
        assert!(
            (17..=24).contains(&tried),
            "tried {tried} of 160 noise blocks"
        );
        // Deep in the run, half noise half zeros and text are still compressed (the byte
        // sample guard), and after one that compresses every block is tried again.
        let mut half = noise(&mut rng);
        half[2048..].fill(0);
        assert!(c.skipped > 0, "deep in a run of noise");
        assert!(c.try_compress(Compression::Lz4, &half).is_some());
        assert_eq!((c.run, c.skipped), (0, 0));
        for _ in 0..SKIP_AFTER + 2 {
            c.try_compress(Compression::Lz4, &noise(&mut rng));
        }
        assert!(c.skipped > 0, "deep in a run of noise again");
        let text: Vec<u8> = (0..4096u32)
            .map(|i| b"condense stores VM disks "[(i % 25) as usize])
            .collect();
        assert!(c.try_compress(Compression::Lz4, &text).is_some());
        assert!(Compressor::default()
            .try_compress(Compression::None, &text)
            .is_none());
        // Larger blocks: the sample is spread over the whole block, still ~241 bytes.
        let mut big = Compressor::default();
        let mut tried = 0;
        for _ in 0..48 {
            let block: Vec<u8> = (0..65536).map(|_| rng.next_u64() as u8).collect();
            assert!(big.try_compress(Compression::Lz4, &block).is_none());
            tried += usize::from(big.skipped == 0);
        }
        assert!(
            (10..=14).contains(&tried),
            "tried {tried} of 48 64 KiB noise blocks"
        );
        let mut text64 = text.repeat(16);
        text64[..2048].copy_from_slice(&noise(&mut rng)[..2048]);
        assert!(big.try_compress(Compression::Lz4, &text64).is_some());
    }

    #[test]
    fn compress_round_trip_and_raw_fallback() -> Result<()> {
        let text: Vec<u8> = (0..4096u32)
            .map(|i| b"condense "[(i % 9) as usize])
            .collect();
        for c in [
            Compression::Lz4,
            Compression::Zstd(3),
            Compression::Zstd(-1),
            Compression::Zstd(-7),
            Compression::None,
        ] {
            let (codec, stored) = compress(c, &text);
            let mut out = vec![0u8; 4096];
            decompress(codec, &stored, &mut out, || "test".into())?;
            assert_eq!(out, text);
            if c != Compression::None {
                assert!(stored.len() < 4096 / 2);
            }
        }
        let mut rng = TestRng::new(1);
        let noise: Vec<u8> = (0..4096).map(|_| rng.next_u64() as u8).collect();
        assert_eq!(compress(Compression::Lz4, &noise).0, ChunkCodec::Raw);
        Ok(())
    }
}
