//! What trained compression dictionaries, faster codecs and compressing neighbouring blocks
//! together would save on a set of VM disk images, against what the pool stores today (each
//! unique 4 KiB block compressed alone, kept only if it saves 1/8: `reduction::try_compress`).
//!
//! The images' unique non-zero 4 KiB blocks are kept in memory in first-write order (about
//! 2.5 GB for the ten-image corpus). A dictionary is trained with zstd's ZDICT (the `zstd`
//! crate, cover algorithm) on a random sample of them, the most favourable sample a pool could
//! train on; LZ4 uses the dictionary's last 64 KiB as its history. Each configuration prints
//! the bytes it stores (payloads, with the 1/8 rule) as a ratio of today's, and its compress
//! and decompress speed on one core.
//!
//!   cargo run --release -p condense-bench --bin dictionary-bench -- /work/corpus/images/*.raw
//!   … -- --sample 20000 --dict-size 114688 IMAGE...
//!
//! Prints figures; asserts nothing.

#[path = "../corpus.rs"]
mod corpus;

use anyhow::{bail, Context, Result};
use clap::Parser;
use corpus::{unique_blocks_announced, BLOCK};
use std::time::Instant;

#[derive(Parser)]
#[command(about = "Stored bytes and speed of dictionaries, codecs and block groups on VM images")]
struct Args {
    /// Raw disk images (sparse files are read by their data extents only).
    images: Vec<String>,
    /// Blocks in the training sample.
    #[arg(long, default_value_t = 20_000)]
    sample: usize,
    /// Dictionary size in bytes (zstd's CLI default is 112640).
    #[arg(long, default_value_t = 112_640)]
    dict_size: usize,
    /// Seed of the sample.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// A small deterministic generator for the sample (xorshift64*).
fn sample(blocks: &[u8], n: usize, seed: u64) -> Vec<&[u8]> {
    let count = blocks.len() / BLOCK;
    let mut s = seed.max(1);
    (0..n.min(count))
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let i = (s.wrapping_mul(0x2545_F491_4F6C_DD1D) % count as u64) as usize;
            &blocks[i * BLOCK..(i + 1) * BLOCK]
        })
        .collect()
}

/// One configuration's figures: stored bytes, and MB/s compressing and decompressing.
struct Figures {
    stored: u64,
    compress_mbs: f64,
    decompress_mbs: f64,
}

/// A decompressor: the payload into a buffer of exactly the unit's length.
type Decompress<'a> = dyn FnMut(&[u8], &mut [u8]) -> Result<()> + 'a;

/// Compress every unit of `unit` bytes (a block, or a group of neighbouring blocks) with `c`,
/// keep it if it saves 1/8, then time decompressing what was kept with `d`.
fn measure(
    blocks: &[u8],
    unit: usize,
    c: &mut dyn FnMut(&[u8]) -> Vec<u8>,
    d: &mut Decompress<'_>,
) -> Result<Figures> {
    let limit = unit - unit / 8;
    let t0 = Instant::now();
    let kept: Vec<Option<Vec<u8>>> = blocks
        .chunks(unit)
        .map(|u| {
            let z = c(u);
            (z.len() <= limit.min(u.len() - u.len() / 8)).then_some(z)
        })
        .collect();
    let compress_s = t0.elapsed().as_secs_f64();
    let stored = kept
        .iter()
        .zip(blocks.chunks(unit))
        .map(|(k, u)| k.as_ref().map_or(u.len(), Vec::len) as u64)
        .sum();
    let mut out = vec![0u8; unit];
    let t1 = Instant::now();
    let mut compressed_bytes = 0u64;
    for (k, u) in kept.iter().zip(blocks.chunks(unit)) {
        if let Some(z) = k {
            d(z, &mut out[..u.len()])?;
            compressed_bytes += u.len() as u64;
        }
    }
    let decompress_s = t1.elapsed().as_secs_f64().max(1e-9);
    Ok(Figures {
        stored,
        compress_mbs: blocks.len() as f64 / 1e6 / compress_s.max(1e-9),
        decompress_mbs: compressed_bytes as f64 / 1e6 / decompress_s,
    })
}

fn zstd_plain(
    level: i32,
) -> Result<(
    zstd::bulk::Compressor<'static>,
    zstd::bulk::Decompressor<'static>,
)> {
    Ok((
        zstd::bulk::Compressor::new(level)?,
        zstd::bulk::Decompressor::new()?,
    ))
}

fn zstd_dict(
    level: i32,
    dict: &[u8],
) -> Result<(
    zstd::bulk::Compressor<'static>,
    zstd::bulk::Decompressor<'static>,
)> {
    let mut c = zstd::bulk::Compressor::with_dictionary(level, dict)?;
    // A record names its dictionary itself; the frame needs neither its id nor a checksum.
    c.set_parameter(zstd::zstd_safe::CParameter::DictIdFlag(false))?;
    c.set_parameter(zstd::zstd_safe::CParameter::ChecksumFlag(false))?;
    Ok((c, zstd::bulk::Decompressor::with_dictionary(dict)?))
}

fn run_zstd(
    blocks: &[u8],
    unit: usize,
    (mut c, mut d): (
        zstd::bulk::Compressor<'static>,
        zstd::bulk::Decompressor<'static>,
    ),
) -> Result<Figures> {
    measure(
        blocks,
        unit,
        &mut |u| c.compress(u).unwrap_or_else(|_| u.to_vec()),
        &mut |z, out| {
            let n = d.decompress_to_buffer(z, out)?;
            if n != out.len() {
                bail!("zstd gave {n} bytes, not {}", out.len());
            }
            Ok(())
        },
    )
}

fn run_lz4(blocks: &[u8], unit: usize, dict: &[u8]) -> Result<Figures> {
    measure(
        blocks,
        unit,
        &mut |u| lz4_flex::block::compress_with_dict(u, dict),
        &mut |z, out| {
            let n = lz4_flex::block::decompress_into_with_dict(z, out, dict)?;
            if n != out.len() {
                bail!("lz4 gave {n} bytes, not {}", out.len());
            }
            Ok(())
        },
    )
}

fn main() -> Result<()> {
    let args = Args::parse();
    let blocks = unique_blocks_announced(&args.images)?;
    let t1 = Instant::now();
    let samples = sample(&blocks, args.sample, args.seed);
    let dict =
        zstd::dict::from_samples(&samples, args.dict_size).context("training the dictionary")?;
    println!(
        "dictionary: {} bytes trained on {} sampled blocks in {:.1} s",
        dict.len(),
        samples.len(),
        t1.elapsed().as_secs_f64()
    );
    let lz4_history = &dict[dict.len().saturating_sub(64 * 1024)..];

    // Each row against today's codec of its kind: the first zstd row, or the first lz4 row.
    let mut zstd_rows: Vec<(String, Figures)> = vec![(
        "zstd:3, 4 KiB alone (today)".into(),
        run_zstd(&blocks, BLOCK, zstd_plain(3)?)?,
    )];
    zstd_rows.push((
        "zstd:3 + trained dictionary".into(),
        run_zstd(&blocks, BLOCK, zstd_dict(3, &dict)?)?,
    ));
    for level in [1, 9] {
        let f = run_zstd(&blocks, BLOCK, zstd_plain(level)?)?;
        zstd_rows.push((format!("zstd:{level}, 4 KiB alone"), f));
    }
    for group in [4, 16, 32] {
        let f = run_zstd(&blocks, group * BLOCK, zstd_plain(3)?)?;
        zstd_rows.push((
            format!("zstd:3, {} KiB of neighbouring blocks", group * 4),
            f,
        ));
    }
    let mut fast_rows: Vec<(String, Figures)> = vec![
        (
            "lz4, 4 KiB alone (today)".into(),
            run_lz4(&blocks, BLOCK, &[])?,
        ),
        (
            "lz4 + dictionary (its last 64 KiB)".into(),
            run_lz4(&blocks, BLOCK, lz4_history)?,
        ),
    ];
    for level in [1, -1, -3] {
        let f = run_zstd(&blocks, BLOCK, zstd_plain(level)?)?;
        fast_rows.push((format!("zstd:{level}, 4 KiB alone"), f));
    }
    fast_rows.push((
        "zstd:1 + trained dictionary".into(),
        run_zstd(&blocks, BLOCK, zstd_dict(1, &dict)?)?,
    ));
    for group in [4, 16] {
        let f = run_lz4(&blocks, group * BLOCK, &[])?;
        fast_rows.push((format!("lz4, {} KiB of neighbouring blocks", group * 4), f));
    }
    println!();
    println!(
        "{:<40} {:>10} {:>9} {:>12} {:>12}",
        "configuration", "stored GB", "× today", "compress", "decompress"
    );
    let today = |rows: &[(String, Figures)]| rows.first().map_or(1, |r| r.1.stored.max(1));
    let (zstd_today, lz4_today) = (today(&zstd_rows), today(&fast_rows));
    let rows = zstd_rows
        .iter()
        .map(|r| (r, zstd_today))
        .chain(fast_rows.iter().map(|r| (r, lz4_today)));
    for ((name, f), against) in rows {
        println!(
            "{:<40} {:>10.3} {:>9.3} {:>7.0} MB/s {:>7.0} MB/s",
            name,
            f.stored as f64 / 1e9,
            f.stored as f64 / against as f64,
            f.compress_mbs,
            f.decompress_mbs
        );
    }
    println!(
        "(× today: zstd rows against zstd:3 alone, lz4 and fast rows against lz4 alone; one core)"
    );
    Ok(())
}
