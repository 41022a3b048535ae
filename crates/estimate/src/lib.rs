//! The library behind `condense estimate IMAGE...`: how much a pool would save on these
//! images, without a pool.
//!
//! Reads every image as the guest sees it (raw directly with holes skipped; qcow2, vmdk, vdi,
//! vhdx through `qemu-img map` + `qemu-nbd`), each only after [`image::open`] checked that it
//! reads no file but itself, cuts it into chunks (fixed blocks as a pool
//! stores them, or CDC for comparison), and reduces each chunk with the engine's own
//! functions, so that the projection is what `condense import` would store. Bytes on disk come
//! from `condense_engine::projection`. Writes nothing and prints nothing: [`run`] returns a
//! [`Report`] that the caller prints as JSON (serde) or as text ([`Report::text`], in text.rs).
//! Output and JSON schema: docs/ESTIMATE.md.

mod analysis;
mod delta;
pub mod error;
mod figures;
/// Entry points of the fuzz targets; not in release builds (feature `fuzzing`, on in
/// fuzz/Cargo.toml and for this crate's own tests).
#[cfg(feature = "fuzzing")]
pub mod fuzz;
pub mod image;
pub mod inspect;
mod nbd_client;
pub mod probe;
mod source;
mod text;

pub use analysis::Chunking;
pub use error::{Error, Result};

use analysis::{Analysis, Cut, Cutter, Sampling};
use condense_engine::index::IndexSetting;
use condense_engine::Compression;
use error::{bail, Context};
use figures::ChunkingFigures;
use probe::Format;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Instant;

/// Bytes read at a time (a multiple of every fixed chunk size).
const PIECE: usize = 8 << 20;

/// What to estimate and how.
#[derive(Debug, Clone)]
pub struct Options {
    /// Disk images: raw (read directly, holes skipped) or anything qemu-img reads.
    pub images: Vec<PathBuf>,
    /// How to cut images into chunks; the first one is reported at the top. Empty: fixed:4K.
    pub chunking: Vec<Chunking>,
    /// Share of unique chunks to compress, in percent. `None`: every unique chunk with LZ4,
    /// 10 % with zstd.
    pub sample: Option<f64>,
    /// Codec of the projected pool; the other codecs are reported too.
    pub compression: Compression,
    /// The images' format (or probe) and whether they may read other files (image.rs).
    pub image: image::ImageOptions,
    /// The projected pool's dedup index (`--index`): sparse is replayed over the chunks.
    pub index: IndexSetting,
    /// Project delta compression (`--delta`): the images' writes replayed through it.
    pub delta: bool,
}

/// Parse a `--sample` percentage such as `10%` (above 0, at most 100).
pub fn parse_percent(s: &str) -> Result<f64, String> {
    let t = s.trim().trim_end_matches('%');
    match t.parse::<f64>() {
        Ok(p) if p > 0.0 && p <= 100.0 => Ok(p),
        _ => Err(format!(
            "invalid sample {s:?}: give a percentage above 0 and at most 100, like 10%"
        )),
    }
}

/// One piece of guest data on its way from the reader thread.
struct Piece {
    image: usize,
    offset: u64,
    data: Vec<u8>,
    extent_end: bool,
}

/// The projection, serialized as the `condense.estimate/1` JSON schema.
#[derive(Serialize)]
pub struct Report {
    schema: &'static str,
    compression: String,
    /// The first chunking's figures, repeated at the top for scripts.
    chunking: String,
    total: figures::Figures,
    images: Vec<figures::ImageFigures>,
    sharing: figures::Sharing,
    index: figures::IndexFigures,
    /// With `--delta`: the first chunking's delta figures (null for CDC or without it).
    delta: Option<figures::DeltaFigures>,
    chunkings: Vec<ChunkingFigures>,
    read_bytes: u64,
    elapsed_seconds: f64,
    read_bytes_per_second: f64,
}

/// Read every image once and project the pool. `progress(done, total)` is called with the
/// bytes of image data read so far (from the calling thread).
pub fn run(args: &Options, progress: &dyn Fn(u64, u64)) -> Result<Report> {
    if args.delta && matches!(args.index, IndexSetting::Sparse { .. }) {
        bail!(
            "--delta with --index sparse is not projected yet (the delta replay takes a dense index's new chunks); estimate them one at a time"
        );
    }
    let chunkings = distinct_chunkings(&args.chunking);
    let images: Vec<source::Image> = args
        .images
        .iter()
        .map(|p| source::open(p, fixed_alignment(&chunkings), &args.image))
        .collect::<Result<_>>()?;
    let names = display_names(&images);
    let sampling = sampling(args);
    let mut analyses: Vec<Analysis> = chunkings
        .iter()
        .map(|&c| {
            let sparse = match args.index {
                IndexSetting::Sparse { budget } => Some(budget),
                IndexSetting::Dense => None,
            };
            Analysis::new(
                c,
                images.len(),
                sampling,
                (sparse, args.delta.then_some(args.compression)),
            )
        })
        .collect();

    let started = Instant::now();
    let read = read_and_analyse(&images, &chunkings, &mut analyses, progress)?;
    let elapsed = started.elapsed().as_secs_f64();
    check_after_read(&images, &analyses)?;
    let results: Vec<ChunkingFigures> = analyses
        .iter()
        .map(|a| figures::build(a, &images, &names, args.compression))
        .collect();
    report(args.compression, results, read, elapsed)
}

/// The chunkings asked for, each once, in order; fixed:4K when none was.
fn distinct_chunkings(asked: &[Chunking]) -> Vec<Chunking> {
    let mut chunkings: Vec<Chunking> = Vec::new();
    for c in asked {
        if !chunkings.contains(c) {
            chunkings.push(*c);
        }
    }
    if chunkings.is_empty() {
        chunkings.push(Chunking::Fixed(4096));
    }
    chunkings
}

/// Which unique chunks get compressed with each codec (`--sample`, or the defaults).
fn sampling(args: &Options) -> Sampling {
    let bp = |p: f64| (p * 100.0).round().clamp(1.0, 10_000.0) as u32;
    let zstd_level = match args.compression {
        Compression::Zstd(l) => l,
        _ => 3,
    };
    Sampling {
        lz4_bp: args.sample.map_or(10_000, bp),
        zstd_bp: args.sample.map_or(1_000, bp),
        zstd_level,
    }
}

/// The alignment the image readers keep: the largest fixed chunk size (4K without one).
fn fixed_alignment(chunkings: &[Chunking]) -> u64 {
    chunkings
        .iter()
        .filter_map(|c| match c {
            Chunking::Fixed(b) => Some(u64::from(*b)),
            Chunking::Cdc(_) => None,
        })
        .max()
        .unwrap_or(4096)
}

/// Read every image's data extents on a reader thread and feed them to the analyses on this
/// one; the bytes read. Five buffers of [`PIECE`] bytes circulate between the two threads.
fn read_and_analyse(
    images: &[source::Image],
    chunkings: &[Chunking],
    analyses: &mut [Analysis],
    progress: &dyn Fn(u64, u64),
) -> Result<u64> {
    let total_data: u64 = images.iter().map(|i| i.data_bytes()).sum();
    progress(0, total_data);
    std::thread::scope(|scope| -> Result<u64> {
        let (full_tx, full_rx) = mpsc::sync_channel::<Piece>(2);
        let (empty_tx, empty_rx) = mpsc::channel::<Vec<u8>>();
        for _ in 0..5 {
            let _ = empty_tx.send(Vec::with_capacity(PIECE));
        }
        let reader = scope.spawn(move || read_pieces(images, &full_tx, &empty_rx));
        let read = analyse_pieces(full_rx, &empty_tx, (images, chunkings), analyses, |read| {
            progress(read, total_data)
        });
        match reader.join() {
            Ok(r) => r?,
            Err(_) => bail!("the image reader thread failed"),
        }
        Ok(read)
    })
}

/// The reader thread: every data extent of every image in pieces of at most [`PIECE`] bytes,
/// each into a buffer taken from `empty`. Stops early (without error) when the analysing side
/// hung up.
fn read_pieces(
    images: &[source::Image],
    full: &mpsc::SyncSender<Piece>,
    empty: &mpsc::Receiver<Vec<u8>>,
) -> Result<()> {
    for (idx, img) in images.iter().enumerate() {
        if img.extents.is_empty() {
            continue;
        }
        let mut r = source::Reader::open(img)?;
        for &(start, len) in &img.extents {
            let end = start + len;
            let mut pos = start;
            while pos < end {
                let n = (PIECE as u64).min(end - pos);
                let Ok(mut buf) = empty.recv() else {
                    return Ok(());
                };
                buf.resize(n as usize, 0);
                r.read_at(pos, &mut buf)
                    .with_context(|| format!("reading image {}", img.path.display()))?;
                let piece = Piece {
                    image: idx,
                    offset: pos,
                    data: buf,
                    extent_end: pos + n == end,
                };
                if full.send(piece).is_err() {
                    return Ok(());
                }
                pos += n;
            }
        }
    }
    Ok(())
}

/// The analysing side: cut and fingerprint piece n while piece n-1 is deduplicated and
/// compressed, hand each finished buffer back on `empty`, report the bytes done through
/// `progress`; the bytes analysed. With `--delta`, the bases of deltas are read back from
/// `images` (a reader of its own per image, opened when first needed).
fn analyse_pieces(
    full: mpsc::Receiver<Piece>,
    empty: &mpsc::Sender<Vec<u8>>,
    (images, chunkings): (&[source::Image], &[Chunking]),
    analyses: &mut [Analysis],
    progress: impl Fn(u64),
) -> u64 {
    let mut cutters: Vec<Cutter> = chunkings.iter().map(|&c| Cutter::new(c)).collect();
    let mut prev: Option<(Piece, Vec<Cut>)> = None;
    let mut read = 0u64;
    let mut readers: Vec<Option<source::Reader>> = images.iter().map(|_| None).collect();
    let mut read_block = move |image: usize, offset: u64, buf: &mut [u8]| -> Result<(), String> {
        let img = images.get(image).ok_or("no such image")?;
        let slot = readers.get_mut(image).ok_or("no such image")?;
        if slot.is_none() {
            *slot = Some(source::Reader::open(img).map_err(|e| e.to_string())?);
        }
        let r = slot.as_mut().ok_or("no reader")?;
        r.read_at(offset, buf).map_err(|e| {
            format!(
                "reading a delta's base back from {} at offset {offset}: {e}",
                img.path.display()
            )
        })
    };
    let mut commit = |prev: &Option<(Piece, Vec<Cut>)>| {
        if let Some((p, cuts)) = prev {
            for (a, cut) in analyses.iter_mut().zip(cuts) {
                a.commit(cut, &p.data, &mut read_block);
            }
        }
    };
    for p in full {
        let (cuts, ()) = rayon::join(
            || {
                cutters
                    .iter_mut()
                    .map(|c| c.cut(p.image, p.offset, &p.data, p.extent_end))
                    .collect::<Vec<Cut>>()
            },
            || commit(&prev),
        );
        if let Some((done, _)) = prev.take() {
            read += done.data.len() as u64;
            progress(read);
            let _ = empty.send(done.data);
        }
        prev = Some((p, cuts));
    }
    commit(&prev);
    if let Some((done, _)) = prev {
        read += done.data.len() as u64;
    }
    read
}

/// Refuse what was read when a checked image changed meanwhile or a pool could not hold it.
fn check_after_read(images: &[source::Image], analyses: &[Analysis]) -> Result<()> {
    if let Some(img) = images
        .iter()
        .find(|i| i.checked.format != Format::Raw && !i.checked.is_unchanged())
    {
        bail!(
            "refusing {}: the image changed while it was read (its size or modification time moved), so what was checked is not what was read; estimate an image nobody is writing to",
            img.path.display()
        );
    }
    if let Some(e) = analyses
        .iter()
        .find_map(|a| a.delta.as_ref()?.read_error.as_ref())
    {
        bail!("{e}; the delta projection needs every base read back, so nothing was projected");
    }
    if let Some(a) = analyses.iter().find(|a| a.overflow) {
        bail!(
            "with {} these images hold more than 2^32 unique chunks, more than one pool can; estimate fewer images or use a larger chunk size",
            a.chunking.label()
        );
    }
    Ok(())
}

/// The report: the first chunking's figures at the top, every chunking's in `chunkings`.
fn report(
    compression: Compression,
    results: Vec<ChunkingFigures>,
    read: u64,
    elapsed: f64,
) -> Result<Report> {
    let first = results.first().context("no chunking to report")?.clone();
    Ok(Report {
        schema: "condense.estimate/1",
        compression: compression.to_string(),
        chunking: first.chunking,
        total: first.total,
        images: first.images,
        sharing: first.sharing,
        index: first.index,
        delta: first.delta,
        chunkings: results,
        read_bytes: read,
        elapsed_seconds: (elapsed * 1000.0).round() / 1000.0,
        read_bytes_per_second: (read as f64 / elapsed.max(1e-9)).round(),
    })
}

/// Image names for tables: file names, or the paths as given where file names repeat.
fn display_names(images: &[source::Image]) -> Vec<String> {
    let file_names: Vec<String> = images
        .iter()
        .map(|i| {
            i.path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| i.name.clone())
        })
        .collect();
    file_names
        .iter()
        .zip(images)
        .map(|(n, i)| {
            if file_names.iter().filter(|m| *m == n).count() > 1 {
                i.path.display().to_string()
            } else {
                n.clone()
            }
        })
        .collect()
}
