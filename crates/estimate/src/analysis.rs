//! The dedup/compression analysis of one chunking over a stream of image data.
//!
//! Chunks are reduced exactly as the engine's write path does (`condense_engine::reduction`):
//! all-zero chunks are only counted; the others are fingerprinted (keyed BLAKE3, in parallel);
//! the first occurrence of a fingerprint becomes a unique chunk, given ids in the order the
//! engine would give them, and only first occurrences are compressed (in parallel; zstd on a
//! sample chosen by fingerprint). Every non-zero chunk's id is kept per image (4 bytes, the
//! same as a block map entry) for the per-image figures and the sharing matrix.
//!
//! With a sparse index to project ([`SparseRun`]), every piece is also replayed as one write
//! of an import (a raw image's import writes the same pieces: 8 MiB of a data range) through
//! `condense_engine::sparse_replay`, each image as its own import; the duplicates that
//! replay stores again are kept per image (4 bytes each).

use condense_engine::format::{Fingerprint, MAP_PAGE_ENTRIES};

/// Map markers as this model codes them (32-bit deltas).
const ENTRY_UNMAPPED: u32 = u32::MAX;
const ENTRY_ZERO: u32 = u32::MAX - 1;
use crate::delta::ReadBlock;
use condense_engine::reduction::{compress, fingerprint, is_zero};
use condense_engine::sparse_replay::SparseReplay;
use condense_engine::Compression;
use rayon::prelude::*;
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

/// Any fixed key gives the same duplicates; this one is only used by `condense estimate`.
pub const KEY: [u8; 32] = *b"condense estimate: fingerprints!";

/// Stored length not measured (chunk outside the sample).
pub const NOT_SAMPLED: u32 = u32::MAX;

/// How images are cut into chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Chunking {
    /// Fixed-size blocks, as a pool with this block size stores them.
    Fixed(u32),
    /// FastCDC (2020) with this average size, min = avg/4, max = avg×4. Estimate only.
    Cdc(u32),
}

impl Chunking {
    /// `fixed:4K`, `cdc:8K`, ...
    pub fn parse(s: &str) -> Result<Chunking, String> {
        let (kind, size) = s.split_once(':').ok_or_else(|| {
            format!("chunking {s:?}: write fixed:SIZE (4K-64K) or cdc:AVG (1K-1M), like fixed:4K")
        })?;
        let size = condense_api::size::parse_size(size)?;
        match kind {
            "fixed" => {
                if !(4096..=65536).contains(&size) || !size.is_power_of_two() {
                    return Err(format!(
                        "chunking {s:?}: a fixed chunk size is a power of two from 4K to 64K (a pool's block size)"
                    ));
                }
                Ok(Chunking::Fixed(size as u32))
            }
            "cdc" => {
                if !(1024..=(1 << 20)).contains(&size) {
                    return Err(format!(
                        "chunking {s:?}: a CDC average size is from 1K to 1M"
                    ));
                }
                Ok(Chunking::Cdc(size as u32))
            }
            _ => Err(format!(
                "chunking {s:?}: unknown kind {kind:?}; use fixed:SIZE or cdc:AVG"
            )),
        }
    }

    pub fn label(&self) -> String {
        match self {
            Chunking::Fixed(b) => format!("fixed:{}", short_size(*b)),
            Chunking::Cdc(b) => format!("cdc:{}", short_size(*b)),
        }
    }

    /// The (average) chunk size.
    pub fn chunk_bytes(&self) -> u32 {
        match self {
            Chunking::Fixed(b) | Chunking::Cdc(b) => *b,
        }
    }

    fn cdc_limits(avg: u32) -> (u32, u32, u32) {
        ((avg / 4).max(256), avg, avg.saturating_mul(4))
    }
}

fn short_size(b: u32) -> String {
    if b.trailing_zeros() >= 20 {
        format!("{}M", b >> 20)
    } else if b.trailing_zeros() >= 10 {
        format!("{}K", b >> 10)
    } else {
        b.to_string()
    }
}

/// Which share of unique chunks is compressed to measure each codec, in basis points.
#[derive(Clone, Copy, Debug)]
pub struct Sampling {
    pub lz4_bp: u32,
    pub zstd_bp: u32,
    pub zstd_level: i8,
}

/// Whether a chunk is in a sample of `bp` basis points: decided by its fingerprint, so the
/// same chunk is always in or out, and the sample is uniform.
fn sampled(sample_key: u16, bp: u32) -> bool {
    bp >= 10_000 || (u32::from(sample_key) * 10_000) >> 16 < bp
}

/// Fingerprints are uniformly random: their first 8 bytes are a perfect hash.
#[derive(Default, Clone, Copy)]
pub struct FpHash;
pub struct FpHasher(u64);
impl BuildHasher for FpHash {
    type Hasher = FpHasher;
    fn build_hasher(&self) -> FpHasher {
        FpHasher(0)
    }
}
impl Hasher for FpHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for (i, &b) in bytes.iter().take(8).enumerate() {
            self.0 |= u64::from(b) << (8 * i);
        }
    }
}

/// A unique chunk.
#[derive(Clone, Copy, Debug)]
pub struct Chunk {
    pub len: u32,
    /// Blocks (chunks) of all images that hold it.
    pub refs: u32,
    /// Stored payload lengths as `reduction::compress` returns them, or [`NOT_SAMPLED`].
    pub lz4: u32,
    pub zstd: u32,
    /// The image it was first seen in (the import that would store it).
    pub first_image: u32,
}

/// How the engine's delta-coded block map of one volume would look: pages touched and the
/// entries where the delta changes (what zstd cannot collapse).
#[derive(Default, Debug, Clone)]
pub struct MapModel {
    pub pages: u64,
    pub breaks: u64,
    last_page: Option<u64>,
    last_block: Option<u64>,
    prev: u32,
    prev_delta: u32,
}

impl MapModel {
    fn entry(&mut self, block: u64, e: u32) {
        let per = MAP_PAGE_ENTRIES as u64;
        let page = block / per;
        // Unmapped entries before this one, inside encoded pages.
        let gap = match self.last_block {
            Some(l) if block > l + 1 => {
                let lp = l / per;
                if lp == page {
                    block - l - 1
                } else {
                    (lp + 1) * per - l - 1 + (block - page * per)
                }
            }
            Some(_) => 0,
            None => block % per,
        };
        if gap > 0 {
            self.feed(ENTRY_UNMAPPED);
            if gap > 1 {
                self.feed(ENTRY_UNMAPPED);
            }
        }
        if self.last_page != Some(page) {
            self.pages += 1;
            self.last_page = Some(page);
        }
        self.feed(e);
        self.last_block = Some(block);
    }

    fn feed(&mut self, e: u32) {
        let d = e.wrapping_sub(self.prev);
        if d != self.prev_delta {
            self.breaks += 1;
        }
        self.prev_delta = d;
        self.prev = e;
    }
}

/// What one image contributed, in this chunking.
#[derive(Default)]
pub struct ImageAcc {
    pub read_bytes: u64,
    pub zero_chunks: u64,
    pub zero_bytes: u64,
    pub nonzero_chunks: u64,
    pub nonzero_bytes: u64,
    /// Non-zero chunks whose content was seen before (in this image or an earlier one).
    pub dup_chunks: u64,
    /// Chunk id of every non-zero chunk, in order.
    pub ids: Vec<u32>,
    pub map: MapModel,
    next_cdc_block: u64,
}

/// One piece of an image cut into chunks and fingerprinted: the part of the work that needs
/// no shared state, so it runs while the previous piece is being committed.
pub struct Cut {
    image: usize,
    read_bytes: u64,
    /// Fixed chunks: the block number of the first one. CDC: none (numbered in order).
    first_block: Option<u64>,
    slices: Vec<(usize, usize)>,
    /// None for an all-zero chunk.
    fps: Vec<Option<Fingerprint>>,
    /// CDC: the bytes the slices point into (the carry from the previous piece + this one).
    owned: Option<Vec<u8>>,
}

/// Cuts the stream of pieces into chunks, for one chunking.
pub struct Cutter {
    chunking: Chunking,
    /// CDC: bytes of the current extent not yet cut (the last, possibly partial, chunk).
    carry: Vec<u8>,
}

impl Cutter {
    pub fn new(chunking: Chunking) -> Cutter {
        Cutter {
            chunking,
            carry: Vec::new(),
        }
    }

    /// Cut and fingerprint the bytes at `offset` of image `image`. Pieces come in image order
    /// and, within an image, in increasing offsets; `extent_end` marks the last piece of a data
    /// range (CDC chunks never span two ranges).
    pub fn cut(&mut self, image: usize, offset: u64, data: &[u8], extent_end: bool) -> Cut {
        let (slices, first_block, owned) = match self.chunking {
            Chunking::Fixed(bs) => {
                let bs = bs as usize;
                let mut slices: Vec<(usize, usize)> =
                    (0..data.len() / bs).map(|i| (i * bs, bs)).collect();
                if data.len() / bs * bs != data.len() {
                    // Only at an unaligned disk end; the engine would not accept such an
                    // image, so count the tail as its own chunk.
                    slices.push((data.len() / bs * bs, data.len() % bs));
                }
                (slices, Some(offset / bs as u64), None)
            }
            Chunking::Cdc(avg) => {
                let (min, avg, max) = Chunking::cdc_limits(avg);
                let mut buf = std::mem::take(&mut self.carry);
                buf.extend_from_slice(data);
                let mut slices: Vec<(usize, usize)> =
                    fastcdc::v2020::FastCDC::new(&buf, min, avg, max)
                        .map(|c| (c.offset, c.length))
                        .collect();
                // The last cut of a piece may move once more data comes: keep it for later.
                if !extent_end {
                    if let Some((start, _)) = slices.pop() {
                        self.carry = buf[start..].to_vec();
                    }
                }
                (slices, None, Some(buf))
            }
        };
        let bytes = owned.as_deref().unwrap_or(data);
        let fps = slices
            .par_iter()
            .with_min_len(64)
            .map(|&(s, l)| {
                let b = &bytes[s..s + l];
                if is_zero(b) {
                    None
                } else {
                    Some(fingerprint(&KEY, b))
                }
            })
            .collect();
        Cut {
            image,
            read_bytes: data.len() as u64,
            first_block,
            slices,
            fps,
            owned,
        }
    }
}

/// The sparse index's inline dedup of the images, each imported in turn into one pool.
pub struct SparseRun {
    pub replay: SparseReplay,
    /// The image being imported (a new one opens the pool again).
    image: Option<usize>,
    /// Per image: the chunk (its id here) of each duplicate its import would store again.
    pub missed: Vec<Vec<u32>>,
    /// Hooks dropped to keep the budget, over every import.
    pub hooks_dropped: u64,
}

impl SparseRun {
    fn new(budget: u64, images: usize) -> SparseRun {
        SparseRun {
            replay: SparseReplay::new(budget),
            image: None,
            missed: vec![Vec::new(); images],
            hooks_dropped: 0,
        }
    }

    /// One piece of `image` written, `ids[i]` its blocks' chunks (`None`: zero) and whether
    /// each was seen before: the duplicates the replay stores are missed.
    fn write(&mut self, image: usize, fps: &[Option<Fingerprint>], ids: &[Option<(u32, bool)>]) {
        if self.image != Some(image) {
            self.hooks_dropped += self.replay.counters().hooks_dropped;
            self.replay.reopen();
            self.image = Some(image);
        }
        for i in self.replay.write(fps) {
            if let Some(Some((id, true))) = ids.get(i) {
                self.missed[image].push(*id);
            }
        }
    }

    /// Hooks dropped over every import so far.
    pub fn hooks_dropped(&self) -> u64 {
        self.hooks_dropped + self.replay.counters().hooks_dropped
    }
}

pub struct Analysis {
    pub chunking: Chunking,
    sampling: Sampling,
    index: HashMap<Fingerprint, u32, FpHash>,
    /// With `--index sparse`: its replay.
    pub sparse: Option<SparseRun>,
    /// With `--delta` (fixed chunkings only): its replay.
    pub delta: Option<crate::delta::DeltaRun>,
    pub chunks: Vec<Chunk>,
    /// Per chunk, `words` u64s: bit i set when image i holds the chunk.
    pub masks: Vec<u64>,
    pub words: usize,
    pub images: Vec<ImageAcc>,
    /// Set when the pool would run out of chunk ids (2^32 chunks).
    pub overflow: bool,
}

impl Analysis {
    /// The analysis of `images` images; `sparse_budget`: also replay a sparse index of
    /// that many bytes; `delta`: also replay delta compression into a pool with this codec
    /// (a fixed chunking only: pools store fixed blocks).
    pub fn new(
        chunking: Chunking,
        images: usize,
        sampling: Sampling,
        (sparse_budget, delta): (Option<u64>, Option<Compression>),
    ) -> Analysis {
        let words = images.div_ceil(64).max(1);
        Analysis {
            chunking,
            sampling,
            index: HashMap::with_hasher(FpHash),
            sparse: sparse_budget.map(|b| SparseRun::new(b, images)),
            delta: match chunking {
                Chunking::Fixed(_) => delta.map(|c| crate::delta::DeltaRun::new(images, c)),
                Chunking::Cdc(_) => None,
            },
            chunks: Vec::new(),
            masks: Vec::new(),
            words,
            images: (0..images).map(|_| ImageAcc::default()).collect(),
            overflow: false,
        }
    }

    /// Count a piece [`Cutter::cut`] prepared: dedup in order, then compress first
    /// occurrences. `piece` is the data that was cut (CDC cuts carry their own bytes);
    /// `read` reads a delta's base back from its image (with `--delta`).
    pub fn commit(&mut self, cut: &Cut, piece: &[u8], read: &mut ReadBlock<'_>) {
        let data = cut.owned.as_deref().unwrap_or(piece);
        let image = cut.image;
        let slices = &cut.slices;
        let fps = &cut.fps;
        let first_block = cut.first_block;
        self.images[image].read_bytes += cut.read_bytes;
        // 2. Dedup, in order: ids as the engine would give them.
        let words = self.words;
        let (word, bit) = (image / 64, 1u64 << (image % 64));
        let mut fresh: Vec<(u32, usize, usize, u16)> = Vec::new();
        // Each block's chunk and whether it was seen before (for the sparse replay).
        let mut block_ids: Vec<Option<(u32, bool)>> = Vec::with_capacity(fps.len());
        let acc = &mut self.images[image];
        for (i, (fp, &(s, l))) in fps.iter().zip(slices).enumerate() {
            let block = match first_block {
                Some(b) => b + i as u64,
                None => {
                    acc.next_cdc_block += 1;
                    acc.next_cdc_block - 1
                }
            };
            let Some(fp) = fp else {
                acc.zero_chunks += 1;
                acc.zero_bytes += l as u64;
                acc.map.entry(block, ENTRY_ZERO);
                block_ids.push(None);
                continue;
            };
            acc.nonzero_chunks += 1;
            acc.nonzero_bytes += l as u64;
            let (id, seen) = match self.index.entry(*fp) {
                Entry::Occupied(o) => {
                    let id = *o.get();
                    let c = &mut self.chunks[id as usize];
                    c.refs = c.refs.saturating_add(1);
                    acc.dup_chunks += 1;
                    (id, true)
                }
                Entry::Vacant(v) => {
                    let id = self.chunks.len() as u32;
                    if u64::from(id) >= condense_engine::format::CHUNK_ID_LIMIT - 1
                        || id >= ENTRY_ZERO - 1
                    {
                        self.overflow = true;
                    }
                    v.insert(id);
                    self.chunks.push(Chunk {
                        len: l as u32,
                        refs: 1,
                        lz4: NOT_SAMPLED,
                        zstd: NOT_SAMPLED,
                        first_image: image as u32,
                    });
                    self.masks.resize(self.masks.len() + words, 0);
                    fresh.push((id, s, l, u16::from_le_bytes([fp[8], fp[9]])));
                    (id, false)
                }
            };
            self.masks[id as usize * words + word] |= bit;
            acc.ids.push(id);
            acc.map.entry(block, id);
            block_ids.push(Some((id, seen)));
        }
        if let Some(sparse) = &mut self.sparse {
            sparse.write(image, fps, &block_ids);
        }
        self.replay_deltas((image, first_block), data, &fresh, read);
        // 3. Compress first occurrences, in parallel.
        let sm = self.sampling;
        let sizes: Vec<(u32, u32)> = fresh
            .par_iter()
            .map(|&(_, s, l, key)| {
                let b = &data[s..s + l];
                let lz4 = if sampled(key, sm.lz4_bp) {
                    compress(Compression::Lz4, b).1.len() as u32
                } else {
                    NOT_SAMPLED
                };
                let zstd = if sampled(key, sm.zstd_bp) {
                    compress(Compression::Zstd(sm.zstd_level), b).1.len() as u32
                } else {
                    NOT_SAMPLED
                };
                (lz4, zstd)
            })
            .collect();
        for (&(id, ..), (lz4, zstd)) in fresh.iter().zip(sizes) {
            let c = &mut self.chunks[id as usize];
            c.lz4 = lz4;
            c.zstd = zstd;
        }
    }

    /// With `--delta`: the piece of `image` from block `first` as one write, its new chunks
    /// `fresh` (id, offset, length, sample key) the misses (whole blocks only).
    fn replay_deltas(
        &mut self,
        (image, first): (usize, Option<u64>),
        data: &[u8],
        fresh: &[(u32, usize, usize, u16)],
        read: &mut ReadBlock<'_>,
    ) {
        if let (Some(delta), Some(first), Chunking::Fixed(bs)) =
            (&mut self.delta, first, self.chunking)
        {
            let bs = bs as usize;
            let misses: Vec<usize> = fresh
                .iter()
                .filter(|f| f.2 == bs)
                .map(|f| f.1 / bs)
                .collect();
            delta.write((image, first * bs as u64), data, bs, &misses, read);
        }
    }

    /// Whether chunk `id` is held by image `i`.
    #[cfg(test)]
    pub fn holds(&self, id: u32, i: usize) -> bool {
        self.masks[id as usize * self.words + i / 64] & (1 << (i % 64)) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Cut and commit in one go.
    struct Feeder(Cutter, Analysis);
    impl Feeder {
        fn new(c: Chunking, images: usize) -> Feeder {
            Feeder(
                Cutter::new(c),
                Analysis::new(c, images, sampling(), (None, None)),
            )
        }
        fn feed(&mut self, image: usize, offset: u64, data: &[u8], end: bool) {
            let cut = self.0.cut(image, offset, data, end);
            self.1
                .commit(&cut, data, &mut |_, _, _| Err("no image".into()));
        }
    }

    fn sampling() -> Sampling {
        Sampling {
            lz4_bp: 10_000,
            zstd_bp: 10_000,
            zstd_level: 3,
        }
    }

    fn noise(seed: u64, n: usize) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn parse_chunkings() {
        assert_eq!(Chunking::parse("fixed:4K"), Ok(Chunking::Fixed(4096)));
        assert_eq!(Chunking::parse("fixed:16K"), Ok(Chunking::Fixed(16384)));
        assert_eq!(Chunking::parse("cdc:8K"), Ok(Chunking::Cdc(8192)));
        assert!(Chunking::parse("fixed:3K").is_err());
        assert!(Chunking::parse("fixed:128K").is_err());
        assert!(Chunking::parse("rabin:8K").is_err());
        assert!(Chunking::parse("8K").is_err());
        assert_eq!(Chunking::Cdc(8192).label(), "cdc:8K");
    }

    #[test]
    fn fixed_dedup_zero_and_ids_in_engine_order() {
        let mut f = Feeder::new(Chunking::Fixed(4096), 2);
        let x = noise(1, 4096);
        let y = noise(2, 4096);
        let mut d = Vec::new();
        d.extend_from_slice(&x);
        d.extend_from_slice(&vec![0; 4096]);
        d.extend_from_slice(&y);
        d.extend_from_slice(&x);
        f.feed(0, 0, &d, true);
        f.feed(1, 8192, &y, true);
        let a = f.1;
        assert_eq!(a.chunks.len(), 2);
        assert_eq!(a.images[0].ids, vec![0, 1, 0]);
        assert_eq!(a.images[1].ids, vec![1]);
        assert_eq!(a.images[0].zero_chunks, 1);
        assert_eq!(a.images[0].dup_chunks, 1);
        assert_eq!(a.images[1].dup_chunks, 1);
        assert_eq!(a.chunks[0].refs, 2);
        assert!(a.holds(1, 0) && a.holds(1, 1) && !a.holds(0, 1));
        // Noise does not compress: stored raw.
        assert_eq!(a.chunks[0].lz4, 4096);
    }

    #[test]
    fn cdc_cuts_do_not_depend_on_piece_boundaries() {
        let data = noise(7, 3 << 20);
        let mut whole = Feeder::new(Chunking::Cdc(8192), 1);
        whole.feed(0, 0, &data, true);
        let mut pieces = Feeder::new(Chunking::Cdc(8192), 1);
        let mut off = 0;
        for p in data.chunks(300_000) {
            let end = off + p.len() == data.len();
            pieces.feed(0, off as u64, p, end);
            off += p.len();
        }
        let lens = |f: &Feeder| f.1.chunks.iter().map(|c| c.len).collect::<Vec<_>>();
        assert_eq!(lens(&whole), lens(&pieces));
        assert!(whole.1.chunks.len() > 200);
        assert_eq!(
            whole.1.chunks.iter().map(|c| u64::from(c.len)).sum::<u64>(),
            data.len() as u64
        );
    }

    #[test]
    fn map_model_counts_pages_and_breaks() {
        let mut m = MapModel::default();
        for b in 0..2 * MAP_PAGE_ENTRIES as u64 {
            m.entry(b, b as u32);
        }
        assert_eq!(m.pages, 2);
        assert_eq!(m.breaks, 1); // delta 0 → 1 once
        let mut m = MapModel::default();
        for b in 0..100u64 {
            m.entry(b * 2, 7);
        }
        assert_eq!(m.pages, 1);
        assert!(m.breaks >= 100);
    }

    #[test]
    fn sample_is_about_the_asked_share() {
        let n = (0..=u16::MAX).filter(|&k| sampled(k, 1000)).count();
        assert!((6400..6700).contains(&n), "{n}");
        assert!((0..=u16::MAX).all(|k| sampled(k, 10_000)));
    }
}
