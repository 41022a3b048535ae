//! What delta compression against a similar stored block would save on a set of VM disk
//! images (issue 26), against what the pool stores today (each unique 4 KiB block compressed
//! alone, kept only if it saves 1/8: `reduction::try_compress`).
//!
//! Each unique non-zero block, in first-write order (the corpus as `dictionary-bench` reads
//! it), gets a sketch: 12 features, each the maximum over sampled positions of a different
//! linear transform `m·h + a` of a gear rolling hash `h` over the last 32 bytes (`--window`;
//! positions are sampled by content, where the hash's top 5 bits are zero: `--sample-bits`),
//! as Odess does. The features are hashed in groups into super-features ("4x3": 4 of 3
//! features; "12x1": each feature alone), and an index maps each super-feature to the most
//! recent block that had it. The candidates a block's super-features find, ranked by how many
//! they share, then by recency, are tried as its base: the block is compressed with the
//! base's 4 KiB as a raw-content zstd dictionary (or LZ4's external dictionary), and the
//! delta is kept if it, plus 8 bytes naming the base, is smaller than the block stored alone
//! (or, with "gain 1/8", saves at least 1/8 of that). A block may be a base only if its chain
//! is shorter than the row's depth limit (depth 1: a base is never itself a delta); blocks
//! that cannot be bases are not indexed. "Together" compresses against several candidates
//! at once (their blocks concatenated as one dictionary): a read then reads every base.
//!
//! Each row prints the payload bytes stored (with the 1/8 rule, and 8 bytes per base named),
//! how many blocks became deltas, what a read costs (base records read per block read, on
//! average and at most, and the decompression speed of the compressed records, counting their
//! bases' decompression), the compression speed (sketch, index, the block alone and every
//! delta tried) and the RAM the index would need in an engine. Speeds are MB per CPU second of
//! the bench's one thread, so other work on the machine slows them less than it would wall
//! time. Every row's records are decompressed once more and compared with the blocks.
//!
//!   cargo build --release -p condense-bench --bin similarity-bench
//!   target/release/similarity-bench /work/corpus/images/*.raw        # ~30 min, ~3 GB RAM
//!   … -- --rows "12x1, depth 1" -- IMAGE...     # only the rows whose name contains these
//!
//! Prints figures; asserts nothing but the round trip.

#[path = "../corpus.rs"]
mod corpus;

use anyhow::{anyhow, bail, Result};
use clap::Parser;
use corpus::{unique_blocks_announced, BLOCK};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::io::Write;
use zstd::zstd_safe::{self, CCtx, DCtx};

/// The pool's rule: a compressed record is kept only if it saves 1/8 of the block.
const LIMIT: usize = BLOCK - BLOCK / 8;
/// Bytes a delta record spends naming its base (a chunk id), counted in its stored size.
const BASE_ID_BYTES: usize = 8;
/// Features per block.
const FEATURES: usize = 12;
/// Most block ids an index key keeps.
const MAX_WAYS: usize = 4;
const NO_ID: u32 = u32::MAX;
/// An index entry as an engine would keep it: a 2-byte tag of the key and a 6-byte chunk id,
/// in a table at 80 % load.
const COMPACT_ENTRY_BYTES: f64 = 8.0 / 0.8;

#[derive(Parser)]
#[command(about = "Stored bytes and read cost of delta compression against similar blocks")]
struct Args {
    /// Raw disk images (sparse files are read by their data extents only).
    images: Vec<String>,
    /// A position feeds the features when the top SAMPLE_BITS bits of its rolling hash are
    /// zero (one position in 2^SAMPLE_BITS).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(0..=16))]
    sample_bits: u32,
    /// Bytes of the rolling hash's window: 64, 32 or 16 (the gear hash shifts by 64/WINDOW
    /// bits a byte).
    #[arg(long, default_value_t = 32)]
    window: u32,
    /// Candidates the upper-bound rows try.
    #[arg(long, default_value_t = 16)]
    bound_tries: usize,
    /// Run only the rows whose name contains one of these (the baselines always run).
    #[arg(long, num_args = 1..)]
    rows: Vec<String>,
}

/// CPU seconds this thread has run: the speeds are per core even on a machine shared with
/// other work (wall time there depends on what else runs).
fn cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the timespec we pass, which we own.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// splitmix64: the gear table and the transforms, from a fixed seed.
fn splitmix(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A 64-bit finalizer (murmur3's) to hash features into super-features.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    x = x.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    x ^ (x >> 33)
}

/// The features of a block (Odess-style: N-transform with content-defined sampling).
struct Sketcher {
    gear: [u64; 256],
    mul: [u64; FEATURES],
    add: [u64; FEATURES],
    /// A position is sampled if its hash is at most this.
    threshold: u64,
    /// Bits the hash shifts a byte: its window is 64 / shift bytes.
    shift: u32,
}

impl Sketcher {
    fn new(sample_bits: u32, window: u32) -> Self {
        let mut s = 26;
        let mut next = || splitmix(&mut s);
        Sketcher {
            gear: std::array::from_fn(|_| next()),
            mul: std::array::from_fn(|_| next() | 1),
            add: std::array::from_fn(|_| next()),
            threshold: u64::MAX >> sample_bits,
            shift: 64 / window,
        }
    }

    /// Feature i is the maximum of `mul[i] * h + add[i]` over the sampled positions' gear hash
    /// `h` (whose top bits depend on the last 64 bytes); `None` if no position was sampled.
    fn features(&self, block: &[u8]) -> Option<[u64; FEATURES]> {
        let mut f = [0u64; FEATURES];
        let mut h = 0u64;
        let mut sampled = false;
        for &b in block {
            h = (h << self.shift).wrapping_add(self.gear[usize::from(b)]);
            if h <= self.threshold {
                sampled = true;
                for ((f, m), a) in f.iter_mut().zip(&self.mul).zip(&self.add) {
                    *f = (*f).max(m.wrapping_mul(h).wrapping_add(*a));
                }
            }
        }
        sampled.then_some(f)
    }
}

/// Keys that are already hashes go to the map as they are.
#[derive(Default)]
struct Passthrough(u64);

impl Hasher for Passthrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = mix(self.0 ^ u64::from(b));
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type Table = HashMap<u64, [u32; MAX_WAYS], BuildHasherDefault<Passthrough>>;

/// How a block's base candidates are found.
#[derive(Clone, Copy)]
enum Finder {
    /// None: every block alone.
    None,
    /// The most recent block that may be a base (no sketch: what locality alone finds).
    Previous,
    /// The first `features` of the 12 features hashed in groups of `per_group` into
    /// super-features, each naming its `ways` most recent blocks; candidates ranked by how
    /// many super-features they share, then by recency, then (if `previous`) the most recent
    /// block that may be a base. 12 groups of one feature, 4 ways and the previous block: the
    /// upper bound's wide net.
    Sketch {
        features: usize,
        per_group: usize,
        ways: usize,
        previous: bool,
    },
}

/// The candidate index of one row.
struct Index {
    finder: Finder,
    tables: Vec<Table>,
    last: u32,
}

impl Index {
    fn new(finder: Finder) -> Self {
        let tables = match finder {
            Finder::None | Finder::Previous => 0,
            Finder::Sketch {
                features,
                per_group,
                ..
            } => features / per_group,
        };
        Index {
            finder,
            tables: (0..tables).map(|_| Table::default()).collect(),
            last: NO_ID,
        }
    }

    fn needs_sketch(&self) -> bool {
        !self.tables.is_empty()
    }

    /// One key per table.
    fn keys(&self, f: &[u64; FEATURES]) -> [u64; FEATURES] {
        let mut k = [0u64; FEATURES];
        match self.finder {
            Finder::Sketch {
                features,
                per_group,
                ..
            } => {
                let groups = f[..features].chunks_exact(per_group);
                for (g, (k, group)) in k.iter_mut().zip(groups).enumerate() {
                    *k = group.iter().fold(g as u64 + 1, |acc, x| mix(acc ^ x));
                }
            }
            Finder::None | Finder::Previous => {}
        }
        k
    }

    fn ways(&self) -> usize {
        match self.finder {
            Finder::Sketch { ways, .. } => ways,
            Finder::None | Finder::Previous => 0,
        }
    }

    /// The candidates, best first: most keys shared, then most recent.
    fn candidates(&self, keys: Option<&[u64; FEATURES]>, out: &mut Vec<(u32, u32)>) {
        out.clear();
        if let Some(keys) = keys {
            for (t, k) in self.tables.iter().zip(keys) {
                for &id in t.get(k).into_iter().flatten().filter(|&&id| id != NO_ID) {
                    match out.iter_mut().find(|(c, _)| *c == id) {
                        Some((_, n)) => *n += 1,
                        None => out.push((id, 1)),
                    }
                }
            }
        }
        let previous = matches!(
            self.finder,
            Finder::Previous | Finder::Sketch { previous: true, .. }
        );
        if previous && self.last != NO_ID && !out.iter().any(|(c, _)| *c == self.last) {
            out.push((self.last, 0));
        }
        out.sort_unstable_by_key(|&(id, shared)| std::cmp::Reverse((shared, id)));
    }

    fn insert(&mut self, keys: Option<&[u64; FEATURES]>, id: u32) {
        self.last = id;
        let ways = self.ways();
        if let Some(keys) = keys {
            for (t, &k) in self.tables.iter_mut().zip(keys) {
                let e = t.entry(k).or_insert([NO_ID; MAX_WAYS]);
                e.copy_within(0..ways - 1, 1);
                e[0] = id;
            }
        }
    }

    /// Block ids held, over all tables.
    fn entries(&self) -> usize {
        let ways = self.ways();
        self.tables
            .iter()
            .flat_map(|t| t.values())
            .map(|e| e[..ways].iter().filter(|&&id| id != NO_ID).count())
            .sum()
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Codec {
    Zstd(i32),
    Lz4,
}

/// A codec's contexts; a dictionary is a base block's raw bytes.
struct Coder {
    codec: Codec,
    cctx: CCtx<'static>,
    dctx: DCtx<'static>,
}

/// zstd takes a dictionary that starts with its magic number for a trained one, any other
/// as raw content (`ZSTD_compress_usingDict`'s auto mode): such a block is never a base.
fn is_zstd_dictionary(block: &[u8]) -> bool {
    block.get(..4) == Some(&zstd_safe::MAGIC_DICTIONARY.to_le_bytes()[..])
}

fn zstd_err(code: usize) -> anyhow::Error {
    anyhow!("zstd: {}", zstd_safe::get_error_name(code))
}

impl Coder {
    fn new(codec: Codec) -> Self {
        Coder {
            codec,
            cctx: CCtx::create(),
            dctx: DCtx::create(),
        }
    }

    fn compress(&mut self, src: &[u8], dict: Option<&[u8]>, dst: &mut Vec<u8>) -> Result<()> {
        match self.codec {
            Codec::Zstd(level) => {
                dst.clear();
                dst.reserve(zstd_safe::compress_bound(src.len()));
                match dict {
                    None => self.cctx.compress(dst, src, level),
                    Some(d) => self.cctx.compress_using_dict(dst, src, d, level),
                }
                .map_err(zstd_err)?;
            }
            Codec::Lz4 => {
                dst.resize(lz4_flex::block::get_maximum_output_size(src.len()), 0);
                let n = match dict {
                    None => lz4_flex::block::compress_into(src, dst),
                    Some(d) => lz4_flex::block::compress_into_with_dict(src, dst, d),
                }?;
                dst.truncate(n);
            }
        }
        Ok(())
    }

    fn decompress(&mut self, src: &[u8], dict: Option<&[u8]>, dst: &mut [u8]) -> Result<()> {
        let n = match self.codec {
            Codec::Zstd(_) => match dict {
                None => self.dctx.decompress(dst, src),
                Some(d) => self.dctx.decompress_using_dict(dst, src, d),
            }
            .map_err(zstd_err)?,
            Codec::Lz4 => match dict {
                None => lz4_flex::block::decompress_into(src, dst),
                Some(d) => lz4_flex::block::decompress_into_with_dict(src, dst, d),
            }?,
        };
        if n != dst.len() {
            bail!("decompressed {n} bytes, not {}", dst.len());
        }
        Ok(())
    }
}

/// One row.
struct Config {
    name: String,
    codec: Codec,
    finder: Finder,
    /// Candidates compressed against, the best kept.
    tries: usize,
    /// A block may be a base only if fewer than this many deltas lead to it (1: bases are
    /// never deltas themselves).
    max_depth: u32,
    /// Keep a delta only if it saves 1/`min_gain` of the block stored alone (0: any saving).
    min_gain: usize,
    /// How the candidates are tried.
    mode: Mode,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// One delta against each of the `tries` candidates, the smallest kept.
    Best,
    /// One delta against all of them together: their blocks concatenated as one dictionary,
    /// the best candidate last (a read then reads every base).
    Together,
    /// Both: each candidate alone, and the first two together; the smallest kept (counting
    /// 8 bytes per base).
    Either,
}

enum Record {
    Raw,
    Alone(Vec<u8>),
    /// Compressed with its bases' blocks, concatenated, as the dictionary.
    Delta {
        bases: Vec<u32>,
        payload: Vec<u8>,
    },
}

/// One row's figures.
struct Figures {
    stored: u64,
    deltas: usize,
    compress_mbs: f64,
    /// Decompressing every compressed record (alone or delta, with its bases).
    decompress_mbs: f64,
    /// Decompressing the deltas alone, each with its bases.
    delta_decompress_mbs: f64,
    /// Base records read per block read, on average over all blocks, and the most.
    extra_reads: f64,
    max_reads: usize,
    index_entries: usize,
}

/// Store every block as `cfg` says.
fn store(blocks: &[u8], sketcher: &Sketcher, cfg: &Config) -> Result<(Vec<Record>, f64, usize)> {
    let mut coder = Coder::new(cfg.codec);
    let mut index = Index::new(cfg.finder);
    let n = blocks.len() / BLOCK;
    let mut records = Vec::with_capacity(n);
    let mut depth: Vec<u32> = Vec::with_capacity(n);
    let (mut alone, mut trial, mut best, mut dict) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut candidates = Vec::new();
    let t = cpu_seconds();
    for (i, b) in blocks.chunks_exact(BLOCK).enumerate() {
        coder.compress(b, None, &mut alone)?;
        let alone_len = if alone.len() <= LIMIT {
            alone.len()
        } else {
            BLOCK
        };
        let features = index.needs_sketch().then(|| sketcher.features(b)).flatten();
        let keys = features.map(|f| index.keys(&f));
        index.candidates(keys.as_ref(), &mut candidates);
        let tried = &candidates[..candidates.len().min(cfg.tries)];
        let block_of = |c: u32| &blocks[c as usize * BLOCK..][..BLOCK];
        let mut best_bases: Vec<u32> = Vec::new();
        if cfg.mode != Mode::Together {
            for &(c, _) in tried {
                coder.compress(b, Some(block_of(c)), &mut trial)?;
                if best_bases.is_empty() || trial.len() < best.len() {
                    std::mem::swap(&mut best, &mut trial);
                    best_bases = vec![c];
                }
            }
        }
        let together = match cfg.mode {
            Mode::Best => 0,
            Mode::Together => tried.len(),
            Mode::Either => tried.len().min(2),
        };
        if together > 1 || (together == 1 && best_bases.is_empty()) {
            let with = &tried[..together];
            dict.clear();
            for &(c, _) in with.iter().rev() {
                dict.extend_from_slice(block_of(c));
            }
            coder.compress(b, Some(&dict), &mut trial)?;
            let cost = |len: usize, bases: usize| len + BASE_ID_BYTES * bases;
            if best_bases.is_empty()
                || cost(trial.len(), together) < cost(best.len(), best_bases.len())
            {
                std::mem::swap(&mut best, &mut trial);
                best_bases = with.iter().map(|&(c, _)| c).collect();
            }
        }
        let needed = match cfg.min_gain {
            0 => alone_len - 1,
            n => alone_len - alone_len / n,
        };
        let delta_len = best.len() + BASE_ID_BYTES * best_bases.len();
        let (record, d) = if !best_bases.is_empty() && best.len() <= LIMIT && delta_len <= needed {
            let d = best_bases.iter().map(|&c| depth[c as usize]).max();
            let record = Record::Delta {
                bases: best_bases,
                payload: best.clone(),
            };
            (record, d.unwrap_or(0) + 1)
        } else if alone_len < BLOCK {
            (Record::Alone(alone.clone()), 0)
        } else {
            (Record::Raw, 0)
        };
        if d < cfg.max_depth && !(matches!(cfg.codec, Codec::Zstd(_)) && is_zstd_dictionary(b)) {
            index.insert(keys.as_ref(), i as u32);
        }
        depth.push(d);
        records.push(record);
    }
    Ok((records, cpu_seconds() - t, index.entries()))
}

/// Reads blocks back as a read would: each delta's bases first (recursively), then the delta.
struct Reader<'a> {
    records: &'a [Record],
    blocks: &'a [u8],
    coder: Coder,
    /// A dictionary buffer per level of recursion.
    scratch: Vec<Vec<u8>>,
    /// Base records read so far.
    base_reads: usize,
}

impl Reader<'_> {
    fn decode(&mut self, j: usize, level: usize, out: &mut [u8]) -> Result<()> {
        match &self.records[j] {
            Record::Raw => out.copy_from_slice(&self.blocks[j * BLOCK..][..BLOCK]),
            Record::Alone(z) => self.coder.decompress(z, None, out)?,
            Record::Delta { bases, payload } => {
                if self.scratch.len() <= level {
                    self.scratch.push(Vec::new());
                }
                let mut dict = std::mem::take(&mut self.scratch[level]);
                dict.resize(bases.len() * BLOCK, 0);
                for (&base, d) in bases.iter().rev().zip(dict.chunks_exact_mut(BLOCK)) {
                    self.base_reads += 1;
                    self.decode(base as usize, level + 1, d)?;
                }
                self.coder.decompress(payload, Some(&dict), out)?;
                self.scratch[level] = dict;
            }
        }
        Ok(())
    }
}

fn measure(blocks: &[u8], sketcher: &Sketcher, cfg: &Config) -> Result<Figures> {
    let (records, compress_s, index_entries) = store(blocks, sketcher, cfg)?;
    let stored = records
        .iter()
        .map(|r| match r {
            Record::Raw => BLOCK,
            Record::Alone(z) => z.len(),
            Record::Delta { bases, payload } => payload.len() + BASE_ID_BYTES * bases.len(),
        } as u64)
        .sum();
    let deltas = records
        .iter()
        .filter(|r| matches!(r, Record::Delta { .. }))
        .count();
    let mut reader = Reader {
        records: &records,
        blocks,
        coder: Coder::new(cfg.codec),
        scratch: Vec::new(),
        base_reads: 0,
    };
    let mut out = vec![0u8; BLOCK];
    // Two timed passes, the records stored alone then the deltas (the raw records need no
    // decompression, as in dictionary-bench), then one pass comparing every block.
    let mut timed = [(0.0f64, 0u64); 2];
    for (pass, (secs, bytes)) in timed.iter_mut().enumerate() {
        let t = cpu_seconds();
        for (i, r) in records.iter().enumerate() {
            let wanted = match r {
                Record::Raw => false,
                Record::Alone(_) => pass == 0,
                Record::Delta { .. } => pass == 1,
            };
            if wanted {
                reader.decode(i, 0, &mut out)?;
                *bytes += BLOCK as u64;
            }
        }
        *secs = (cpu_seconds() - t).max(1e-9);
    }
    reader.base_reads = 0;
    let mut max_reads = 0usize;
    for (i, b) in blocks.chunks_exact(BLOCK).enumerate() {
        let before = reader.base_reads;
        reader.decode(i, 0, &mut out)?;
        if out != b {
            bail!("{}: block {i} did not round-trip", cfg.name);
        }
        max_reads = max_reads.max(reader.base_reads - before);
    }
    let extra = reader.base_reads;
    let mbs = |bytes: u64, secs: f64| bytes as f64 / 1e6 / secs;
    Ok(Figures {
        stored,
        deltas,
        compress_mbs: mbs(blocks.len() as u64, compress_s),
        decompress_mbs: mbs(timed[0].1 + timed[1].1, timed[0].0 + timed[1].0),
        delta_decompress_mbs: if timed[1].1 == 0 {
            f64::NAN
        } else {
            mbs(timed[1].1, timed[1].0)
        },
        extra_reads: extra as f64 / (blocks.len() / BLOCK).max(1) as f64,
        max_reads,
        index_entries,
    })
}

/// A row, named by its codec, finder, depth limit and tries.
fn row(codec: Codec, finder: Finder, tries: usize, max_depth: u32, mode: Mode) -> Config {
    let codec_name = match codec {
        Codec::Zstd(level) => format!("zstd:{level}"),
        Codec::Lz4 => "lz4".to_string(),
    };
    let what = match finder {
        Finder::None => "alone".to_string(),
        Finder::Previous => "delta vs previous block".to_string(),
        Finder::Sketch {
            features,
            per_group,
            ways,
            previous,
        } => format!(
            "sketch {}x{per_group}{}{}",
            features / per_group,
            if ways > 1 {
                format!(" {ways} ways")
            } else {
                String::new()
            },
            if previous { " + previous" } else { "" }
        ),
    };
    let depth = if max_depth == u32::MAX {
        "any depth".to_string()
    } else {
        format!("depth {max_depth}")
    };
    let tried = match (tries, mode) {
        (1, _) => "top 1".to_string(),
        (_, Mode::Best) => format!("best of {tries}"),
        (_, Mode::Together) => format!("top {tries} together"),
        (_, Mode::Either) => format!("best of {tries} or top 2 together"),
    };
    Config {
        name: format!("{codec_name} {what}, {depth}, {tried}"),
        codec,
        finder,
        tries,
        max_depth,
        min_gain: 0,
        mode,
    }
}

fn configs(bound_tries: usize) -> Vec<Config> {
    let z3 = Codec::Zstd(3);
    let sk = |features, per_group| Finder::Sketch {
        features,
        per_group,
        ways: 1,
        previous: false,
    };
    let any = u32::MAX;
    let alone = |codec, name: &str| Config {
        name: name.to_string(),
        ..row(codec, Finder::None, 0, 1, Mode::Best)
    };
    let gain = |mut c: Config, n: usize| {
        c.name.push_str(&format!(", gain 1/{n}"));
        c.min_gain = n;
        c
    };
    let (best, together, either) = (Mode::Best, Mode::Together, Mode::Either);
    let mut rows = vec![
        alone(z3, "zstd:3 alone (today)"),
        row(z3, Finder::Previous, 1, 1, best),
    ];
    // How the super-features are made: 3 or 4 of 3-4 features (Finesse / Odess), or each
    // feature its own.
    for (features, per_group) in [(12, 4), (12, 3), (12, 2), (4, 1), (6, 1), (12, 1)] {
        rows.push(row(z3, sk(features, per_group), 1, 1, best));
    }
    // How many candidates: the best of several, or several together as one dictionary.
    rows.push(row(z3, sk(12, 3), 4, 1, best));
    for (tries, mode) in [(2, best), (4, best), (2, together), (4, together)] {
        rows.push(row(z3, sk(12, 1), tries, 1, mode));
    }
    // Keeping only the deltas that save 1/8 or 1/4 (the others stay eligible as bases).
    rows.push(gain(row(z3, sk(12, 1), 4, 1, best), 8));
    rows.push(gain(row(z3, sk(12, 1), 4, 1, best), 4));
    rows.push(gain(row(z3, sk(12, 1), 2, 1, together), 8));
    for features in [4, 6, 12] {
        if features < 12 {
            rows.push(gain(row(z3, sk(features, 1), 4, 1, best), 8));
        }
        rows.push(gain(row(z3, sk(features, 1), 4, 1, either), 8));
    }
    // How deep a chain.
    rows.push(row(z3, sk(12, 1), 4, 2, best));
    rows.push(gain(row(z3, sk(12, 1), 4, 2, best), 8));
    rows.push(row(z3, sk(12, 1), 1, any, best));
    rows.push(row(z3, sk(12, 1), 4, any, best));
    // The wide net: every feature's 4 most recent blocks and the previous block.
    let wide = Finder::Sketch {
        features: FEATURES,
        per_group: 1,
        ways: MAX_WAYS,
        previous: true,
    };
    for (depth, min_gain) in [(1, 8), (any, 0)] {
        let mut bound = row(z3, wide, bound_tries, depth, best);
        if min_gain > 0 {
            bound = gain(bound, min_gain);
        }
        bound.name.push_str(" (bound)");
        rows.push(bound);
    }
    let lz4 = Codec::Lz4;
    rows.push(alone(lz4, "lz4 alone (today)"));
    rows.push(row(lz4, sk(12, 3), 1, 1, best));
    rows.push(row(lz4, sk(12, 1), 1, 1, best));
    rows.push(gain(row(lz4, sk(12, 1), 4, 1, best), 8));
    rows.push(gain(row(lz4, sk(12, 1), 4, 1, either), 8));
    rows
}

fn main() -> Result<()> {
    let args = Args::parse();
    if ![16, 32, 64].contains(&args.window) {
        bail!("--window is 64, 32 or 16");
    }
    let blocks = unique_blocks_announced(&args.images)?;
    let unique = blocks.len() / BLOCK;
    let sketcher = Sketcher::new(args.sample_bits, args.window);
    let t1 = cpu_seconds();
    let mut unsampled = 0;
    for b in blocks.chunks_exact(BLOCK) {
        let f = sketcher.features(b);
        unsampled += usize::from(f.is_none());
        std::hint::black_box(f);
    }
    let magic = blocks
        .chunks_exact(BLOCK)
        .filter(|b| is_zstd_dictionary(b))
        .count();
    println!(
        "sketch (12 features, {}-byte window, 1 position in {} sampled): {:.0} MB per CPU second; {unsampled} \
         blocks with no sampled position (never a base, never look one up); {magic} blocks \
         starting with zstd's dictionary magic (never a zstd base)",
        args.window,
        1u32 << args.sample_bits,
        blocks.len() as f64 / 1e6 / (cpu_seconds() - t1),
    );
    println!();
    println!(
        "{:<66} {:>7} {:>7} {:>15} {:>12} {:>9} {:>10} {:>17}",
        "configuration", "GB", "× today", "deltas", "reads/read", "index", "compress", "decompress",
    );
    println!(
        "{:<66} {:>7} {:>7} {:>15} {:>12} {:>9} {:>10} {:>17}",
        "", "", "", "", "(avg, max)", "B/block", "MB/s", "MB/s (deltas)",
    );
    let mut today = HashMap::new();
    for cfg in configs(args.bound_tries) {
        let baseline = matches!(cfg.finder, Finder::None);
        if !baseline && !args.rows.is_empty() && !args.rows.iter().any(|r| cfg.name.contains(r)) {
            continue;
        }
        let f = measure(&blocks, &sketcher, &cfg)?;
        let codec = matches!(cfg.codec, Codec::Lz4);
        if baseline {
            today.insert(codec, f.stored.max(1));
        }
        let against = today.get(&codec).copied().unwrap_or(1);
        println!(
            "{:<66} {:>7.3} {:>7.3} {:>7} {:>5.1} % {:>6.2} {:>5} {:>9.1} {:>10.0} {:>7.0} ({:>5.0})",
            cfg.name,
            f.stored as f64 / 1e9,
            f.stored as f64 / against as f64,
            f.deltas,
            100.0 * f.deltas as f64 / unique.max(1) as f64,
            f.extra_reads,
            f.max_reads,
            f.index_entries as f64 * COMPACT_ENTRY_BYTES / unique.max(1) as f64,
            f.compress_mbs,
            f.decompress_mbs,
            f.delta_decompress_mbs,
        );
        std::io::stdout().flush()?;
    }
    println!(
        "(× today: zstd rows against zstd:3 alone, lz4 rows against lz4 alone; stored = \
         payloads + 8 bytes per base a delta names; index = entries × 8 bytes at 80 % \
         load; speeds in MB per CPU second of one thread)"
    );
    Ok(())
}
