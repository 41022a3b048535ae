//! From an [`Analysis`] to the figures `condense estimate` reports (schema in docs/ESTIMATE.md).
//! Bytes on disk come from `condense_engine::projection::project`, the one projection formula.

use super::analysis::{Analysis, Chunk, ImageAcc, NOT_SAMPLED};
use super::delta::DeltaRun;
use super::source::Image;
use condense_engine::format::RECORD_HEADER_BYTES;
use condense_engine::index::IndexSetting;
use condense_engine::projection::{
    project, saving_percent, Projection, ProjectionInput, DEFAULT_SEGMENT_BYTES,
};
use condense_engine::Compression;
use serde::Serialize;

const RECORD: f64 = RECORD_HEADER_BYTES as f64;

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// 100 × (1 − part / of), 0 when there is nothing.
fn saved(part: f64, of: f64) -> f64 {
    if of <= 0.0 {
        0.0
    } else {
        round2(100.0 * (1.0 - part / of))
    }
}

fn percent(part: f64, of: f64) -> f64 {
    if of <= 0.0 {
        0.0
    } else {
        round2(100.0 * part / of)
    }
}

/// The codecs every estimate projects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    None,
    Lz4,
    Zstd,
}

impl Codec {
    pub const ALL: [Codec; 3] = [Codec::Lz4, Codec::Zstd, Codec::None];

    pub fn of(c: Compression) -> Codec {
        match c {
            Compression::None => Codec::None,
            Compression::Lz4 => Codec::Lz4,
            Compression::Zstd(_) => Codec::Zstd,
        }
    }

    fn index(self) -> usize {
        match self {
            Codec::Lz4 => 0,
            Codec::Zstd => 1,
            Codec::None => 2,
        }
    }
}

/// Projected stored payload lengths: measured where sampled, else the chunk's length times the
/// ratio the sample showed.
struct Stored {
    ratio: [f64; 3],
    sampled_percent: [f64; 3],
}

impl Stored {
    fn new(chunks: &[Chunk]) -> Stored {
        let mut len = [0f64; 2];
        let mut stored = [0f64; 2];
        let mut n = [0u64; 2];
        for c in chunks {
            for (k, v) in [c.lz4, c.zstd].into_iter().enumerate() {
                if v != NOT_SAMPLED {
                    len[k] += f64::from(c.len);
                    stored[k] += f64::from(v);
                    n[k] += 1;
                }
            }
        }
        let ratio = |k: usize| {
            if len[k] > 0.0 {
                stored[k] / len[k]
            } else {
                1.0
            }
        };
        let share = |k: usize| {
            if chunks.is_empty() {
                100.0
            } else {
                round2(100.0 * n[k] as f64 / chunks.len() as f64)
            }
        };
        Stored {
            ratio: [ratio(0), ratio(1), 1.0],
            sampled_percent: [share(0), share(1), 100.0],
        }
    }

    fn get(&self, c: &Chunk, codec: Codec) -> f64 {
        let measured = match codec {
            Codec::Lz4 => c.lz4,
            Codec::Zstd => c.zstd,
            Codec::None => c.len,
        };
        if measured != NOT_SAMPLED {
            f64::from(measured)
        } else {
            f64::from(c.len) * self.ratio[codec.index()]
        }
    }
}

#[derive(Serialize, Clone, Debug)]
pub struct CodecFigures {
    pub codec: String,
    /// Payload bytes of the unique chunks after compression (raw where it saved < 1/8).
    pub stored_bytes: u64,
    pub compression_saving_percent: f64,
    /// Share of unique chunks actually compressed; the rest are extrapolated.
    pub sampled_percent: f64,
    pub projected_physical_bytes: u64,
    pub projected_saving_percent: f64,
}

#[derive(Serialize, Clone, Debug, Default)]
pub struct Figures {
    pub logical_bytes: u64,
    pub allocated_bytes: u64,
    pub zero_bytes: u64,
    pub zero_chunks: u64,
    pub nonzero_bytes: u64,
    pub nonzero_chunks: u64,
    pub unique_chunks: u64,
    pub unique_bytes: u64,
    pub duplicate_chunks: u64,
    pub dedup_saving_percent: f64,
    pub compression_saving_percent: f64,
    pub stored_bytes: u64,
    pub projected_data_bytes: u64,
    pub projected_metadata_bytes: u64,
    pub projected_physical_bytes: u64,
    pub projected_saving_percent: f64,
    pub index_ram_bytes: u64,
    pub ram_bytes_per_unique_chunk: f64,
    pub codecs: Vec<CodecFigures>,
}

#[derive(Serialize, Clone, Debug)]
pub struct ImageFigures {
    pub name: String,
    pub path: String,
    pub format: String,
    pub file_bytes: u64,
    #[serde(flatten)]
    pub figures: Figures,
    /// Chunks first seen in this image (what importing the images in order adds for it).
    pub new_chunks: u64,
    pub new_bytes: u64,
    /// Its share of the whole set's data bytes, as `condense stats` counts a volume's
    /// `physical_bytes`: each chunk's record divided among the blocks that use it.
    pub shared_physical_bytes: u64,
}

#[derive(Serialize, Clone, Debug)]
pub struct Sharing {
    pub images: Vec<String>,
    /// bytes[a][b]: non-zero bytes of image a whose content image b also holds; on the
    /// diagonal, bytes of a that duplicate other bytes of a.
    pub bytes: Vec<Vec<u64>>,
    /// percent[a][b] = 100 × bytes[a][b] / nonzero_bytes of a.
    pub percent: Vec<Vec<f64>>,
}

/// The projected pool's dedup index (`--index`): its RAM, and in sparse mode what it would
/// find inline, each image imported in turn. `total` projects every duplicate found (a dense
/// index).
#[derive(Serialize, Clone, Debug)]
pub struct IndexFigures {
    /// `dense` or `sparse`.
    pub mode: &'static str,
    /// The sparse index's budget (`--index-memory`); 0 for dense.
    pub budget_bytes: u64,
    /// RAM of the dedup index in this mode (`dedup_index_bytes` of `condense stats`).
    pub ram_bytes: u64,
    /// RAM a dense index of these chunks would take.
    pub dense_ram_bytes: u64,
    /// Chunks the pool would hold: the unique ones, and the duplicates the index misses
    /// inline, stored again.
    pub stored_chunks: u64,
    pub missed_duplicate_chunks: u64,
    /// 100 × duplicates found inline / duplicate chunks (100 with nothing to find).
    pub inline_dedup_percent: f64,
    /// Payload bytes of the stored chunks with the chosen codec.
    pub stored_bytes: u64,
    pub projected_physical_bytes: u64,
    pub projected_saving_percent: f64,
    /// Hooks the sparse index dropped, the oldest first, to keep its budget: past its dedup
    /// window (0 for dense).
    pub hooks_dropped: u64,
}

#[derive(Serialize, Clone, Debug)]
pub struct ChunkingFigures {
    pub chunking: String,
    pub chunk_bytes: u32,
    pub total: Figures,
    pub images: Vec<ImageFigures>,
    pub sharing: Sharing,
    pub index: IndexFigures,
    /// With `--delta` (fixed chunkings): what delta compression would store.
    pub delta: Option<DeltaFigures>,
}

/// The projected pool with delta compression (`--delta`, docs/ESTIMATE.md "Delta
/// compression"), from the replay of every import: the selected codec's payload bytes of
/// every unique chunk stored alone (as the write path compresses them, every chunk measured)
/// and with the deltas the write path would make.
#[derive(Serialize, Clone, Debug)]
pub struct DeltaFigures {
    /// The codec of the blocks stored alone (deltas are zstd level 3).
    pub codec: String,
    /// Payload bytes of the unique chunks without deltas, and with them.
    pub stored_bytes_without: u64,
    pub stored_bytes: u64,
    /// Chunks stored as deltas, and the payload bytes they save against being stored alone.
    pub delta_chunks: u64,
    pub saved_bytes: u64,
    /// 100 × saved_bytes / stored_bytes_without.
    pub delta_saving_percent: f64,
    /// The pool's bytes on disk (as `projected_physical_bytes`) without deltas and with them,
    /// and the saving with them (of `nonzero_bytes`, metadata included).
    pub projected_physical_bytes_without: u64,
    pub projected_physical_bytes: u64,
    pub projected_saving_percent: f64,
    /// The sketch index's RAM (a fixed table), per unique chunk, and the RAM of index and
    /// maps with it (what `condense stats` reports as `index_ram_bytes` of a delta pool).
    pub sketch_index_bytes: u64,
    pub sketch_index_bytes_per_unique_chunk: f64,
    pub index_ram_bytes: u64,
    /// Sketch index lookups (one per new chunk with a sketch) and those that found a
    /// candidate, over every import.
    pub sketch_lookups: u64,
    pub sketch_hits: u64,
}

/// What one pool (or one image alone) would hold, in raw numbers.
#[derive(Clone)]
struct Tally {
    logical: u64,
    allocated: u64,
    zero_bytes: u64,
    zero_chunks: u64,
    nonzero_bytes: u64,
    nonzero_chunks: u64,
    unique_chunks: u64,
    unique_bytes: u64,
    stored: [f64; 3],
    record_bytes_per_import: [Vec<u64>; 3],
    map_pages: u64,
    map_breaks: u64,
    volumes: u64,
    name_bytes: u64,
    index: IndexSetting,
}

fn figures(t: &Tally, selected: Codec, zstd_level: i8, stored: &Stored) -> Figures {
    let proj = |k: Codec| -> Projection {
        project(&ProjectionInput {
            unique_chunks: t.unique_chunks,
            stored_payload_bytes: t.stored[k.index()].round() as u64,
            record_bytes_per_import: t.record_bytes_per_import[k.index()].clone(),
            map_pages: t.map_pages,
            map_breaks: t.map_breaks,
            volumes: t.volumes,
            volume_name_bytes: t.name_bytes,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            index: t.index,
        })
    };
    let codecs: Vec<CodecFigures> = Codec::ALL
        .iter()
        .map(|&k| {
            let p = proj(k);
            CodecFigures {
                codec: match k {
                    Codec::Lz4 => "lz4".into(),
                    Codec::Zstd => format!("zstd:{zstd_level}"),
                    Codec::None => "none".into(),
                },
                stored_bytes: t.stored[k.index()].round() as u64,
                compression_saving_percent: saved(t.stored[k.index()], t.unique_bytes as f64),
                sampled_percent: stored.sampled_percent[k.index()],
                projected_physical_bytes: p.physical_bytes,
                projected_saving_percent: round2(saving_percent(p.physical_bytes, t.nonzero_bytes)),
            }
        })
        .collect();
    let p = proj(selected);
    let sel = &codecs[selected.index()];
    Figures {
        logical_bytes: t.logical,
        allocated_bytes: t.allocated,
        zero_bytes: t.zero_bytes,
        zero_chunks: t.zero_chunks,
        nonzero_bytes: t.nonzero_bytes,
        nonzero_chunks: t.nonzero_chunks,
        unique_chunks: t.unique_chunks,
        unique_bytes: t.unique_bytes,
        duplicate_chunks: t.nonzero_chunks - t.unique_chunks.min(t.nonzero_chunks),
        dedup_saving_percent: saved(t.unique_bytes as f64, t.nonzero_bytes as f64),
        compression_saving_percent: sel.compression_saving_percent,
        stored_bytes: sel.stored_bytes,
        projected_data_bytes: p.data_bytes,
        projected_metadata_bytes: p.metadata_bytes,
        projected_physical_bytes: p.physical_bytes,
        projected_saving_percent: round2(saving_percent(p.physical_bytes, t.nonzero_bytes)),
        index_ram_bytes: p.index_ram_bytes,
        ram_bytes_per_unique_chunk: if t.unique_chunks == 0 {
            0.0
        } else {
            round2(p.index_ram_bytes as f64 / t.unique_chunks as f64)
        },
        codecs,
    }
}

/// Per image: its own distinct chunks, and the chunks it adds first (what its import would
/// store); and the stored payload of all chunks.
struct PerImage {
    own_chunks: Vec<u64>,
    own_bytes: Vec<u64>,
    own_stored: Vec<[f64; 3]>,
    new_chunks: Vec<u64>,
    new_bytes: Vec<u64>,
    new_records: Vec<[f64; 3]>,
    total_stored: [f64; 3],
}

impl PerImage {
    /// Count every chunk once for the image that adds it first and once for each image that
    /// holds it.
    fn count(a: &Analysis, stored: &Stored, n: usize) -> PerImage {
        let mut own_chunks = vec![0u64; n];
        let mut own_bytes = vec![0u64; n];
        let mut own_stored = vec![[0f64; 3]; n];
        let mut new_chunks = vec![0u64; n];
        let mut new_bytes = vec![0u64; n];
        let mut new_records = vec![[0f64; 3]; n];
        let mut total_stored = [0f64; 3];
        for (id, c) in a.chunks.iter().enumerate() {
            let st = Codec::ALL.map(|k| stored.get(c, k));
            let f = c.first_image as usize;
            // The image that adds a chunk first holds it.
            debug_assert!(a.masks[id * a.words + f / 64] & (1 << (f % 64)) != 0);
            new_chunks[f] += 1;
            new_bytes[f] += u64::from(c.len);
            for k in Codec::ALL {
                let i = k.index();
                total_stored[i] += st[i];
                new_records[f][i] += RECORD + st[i];
            }
            for w in 0..a.words {
                let mut bits = a.masks[id * a.words + w];
                while bits != 0 {
                    let img = w * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    own_chunks[img] += 1;
                    own_bytes[img] += u64::from(c.len);
                    for k in Codec::ALL {
                        own_stored[img][k.index()] += st[k.index()];
                    }
                }
            }
        }
        // Each chunk is added first by exactly one image.
        debug_assert_eq!(new_chunks.iter().sum::<u64>(), a.chunks.len() as u64);
        PerImage {
            own_chunks,
            own_bytes,
            own_stored,
            new_chunks,
            new_bytes,
            new_records,
            total_stored,
        }
    }
}

/// The sharing matrix (bytes of image i's chunks that image j also holds; the diagonal:
/// bytes of chunks i holds more than once) and each image's share of the data bytes.
fn sharing(a: &Analysis, stored: &Stored, selected: Codec, n: usize) -> (Vec<Vec<u64>>, Vec<f64>) {
    let mut sharing_bytes = vec![vec![0u64; n]; n];
    let mut shared_physical = vec![0f64; n];
    let mut counts = vec![0u32; a.chunks.len()];
    for (img, acc) in a.images.iter().enumerate() {
        for &id in &acc.ids {
            counts[id as usize] = counts[id as usize].saturating_add(1);
        }
        let row = &mut sharing_bytes[img];
        for &id in &acc.ids {
            let c = &a.chunks[id as usize];
            let len = u64::from(c.len);
            if counts[id as usize] >= 2 {
                row[img] += len;
            }
            for w in 0..a.words {
                let mut bits = a.masks[id as usize * a.words + w];
                while bits != 0 {
                    let other = w * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    if other != img {
                        row[other] += len;
                    }
                }
            }
            shared_physical[img] += (RECORD + stored.get(c, selected)) / f64::from(c.refs.max(1));
        }
        for &id in &acc.ids {
            counts[id as usize] = 0;
        }
    }
    (sharing_bytes, shared_physical)
}

/// A byte figure kept as f64 while summing, rounded for the report.
fn to_u64(v: f64) -> u64 {
    v.round() as u64
}

/// What image `i` alone would hold, as if imported into an empty pool.
fn image_tally(i: usize, img: &Image, acc: &ImageAcc, per: &PerImage, name: &str) -> Tally {
    Tally {
        logical: img.logical_bytes,
        allocated: acc.read_bytes,
        zero_bytes: acc.zero_bytes,
        zero_chunks: acc.zero_chunks,
        nonzero_bytes: acc.nonzero_bytes,
        nonzero_chunks: acc.nonzero_chunks,
        unique_chunks: per.own_chunks[i],
        unique_bytes: per.own_bytes[i],
        stored: per.own_stored[i],
        record_bytes_per_import: Codec::ALL.map(|k| {
            vec![to_u64(
                per.own_chunks[i] as f64 * RECORD + per.own_stored[i][k.index()],
            )]
        }),
        map_pages: acc.map.pages,
        map_breaks: acc.map.breaks,
        volumes: 1,
        name_bytes: name.len() as u64,
        index: IndexSetting::Dense,
    }
}

/// What one pool holding all images, imported in order, would hold.
fn total_tally(a: &Analysis, images: &[Image], names: &[String], per: &PerImage) -> Tally {
    Tally {
        logical: images.iter().map(|i| i.logical_bytes).sum(),
        allocated: a.images.iter().map(|x| x.read_bytes).sum(),
        zero_bytes: a.images.iter().map(|x| x.zero_bytes).sum(),
        zero_chunks: a.images.iter().map(|x| x.zero_chunks).sum(),
        nonzero_bytes: a.images.iter().map(|x| x.nonzero_bytes).sum(),
        nonzero_chunks: a.images.iter().map(|x| x.nonzero_chunks).sum(),
        unique_chunks: a.chunks.len() as u64,
        unique_bytes: per.new_bytes.iter().sum(),
        stored: per.total_stored,
        record_bytes_per_import: Codec::ALL.map(|k| {
            per.new_records
                .iter()
                .map(|r| to_u64(r[k.index()]))
                .collect()
        }),
        map_pages: a.images.iter().map(|x| x.map.pages).sum(),
        map_breaks: a.images.iter().map(|x| x.map.breaks).sum(),
        volumes: images.len() as u64,
        name_bytes: names.iter().map(|s| s.len() as u64).sum(),
        index: IndexSetting::Dense,
    }
}

/// The dedup index's figures: dense from `dense` (the total), sparse from the total with the
/// duplicates the replay missed stored again, each in the record bytes of its import. (The
/// block maps are the dense ones': a duplicate stored again breaks a run of ids or extends
/// one, a few bytes of metadata either way.)
fn index_figures(
    a: &Analysis,
    total: Tally,
    dense: &Figures,
    stored: &Stored,
    selected: Codec,
    zstd_level: i8,
) -> IndexFigures {
    let dense_ram = dense.index_ram_bytes;
    let Some(sparse) = &a.sparse else {
        return IndexFigures {
            mode: "dense",
            budget_bytes: 0,
            ram_bytes: dense_ram,
            dense_ram_bytes: dense_ram,
            stored_chunks: dense.unique_chunks,
            missed_duplicate_chunks: 0,
            inline_dedup_percent: 100.0,
            stored_bytes: dense.stored_bytes,
            projected_physical_bytes: dense.projected_physical_bytes,
            projected_saving_percent: dense.projected_saving_percent,
            hooks_dropped: 0,
        };
    };
    let mut t = total;
    let mut missed = 0u64;
    for (img, ids) in sparse.missed.iter().enumerate() {
        missed += ids.len() as u64;
        for &id in ids {
            let c = &a.chunks[id as usize];
            for k in Codec::ALL {
                let st = stored.get(c, k);
                t.stored[k.index()] += st;
                if let Some(r) = t.record_bytes_per_import[k.index()].get_mut(img) {
                    *r += to_u64(RECORD + st);
                }
            }
        }
    }
    t.unique_chunks += missed;
    let budget = sparse.replay.budget();
    t.index = IndexSetting::Sparse { budget };
    let f = figures(&t, selected, zstd_level, stored);
    let duplicates = dense.duplicate_chunks;
    IndexFigures {
        mode: "sparse",
        budget_bytes: budget,
        ram_bytes: f.index_ram_bytes,
        dense_ram_bytes: dense_ram,
        stored_chunks: t.unique_chunks,
        missed_duplicate_chunks: missed,
        inline_dedup_percent: if duplicates == 0 {
            100.0
        } else {
            round2(100.0 * duplicates.saturating_sub(missed) as f64 / duplicates as f64)
        },
        stored_bytes: f.stored_bytes,
        projected_physical_bytes: f.projected_physical_bytes,
        projected_saving_percent: f.projected_saving_percent,
        hooks_dropped: sparse.hooks_dropped(),
    }
}

/// All figures of one chunking.
pub fn build(
    a: &Analysis,
    images: &[Image],
    names: &[String],
    compression: Compression,
) -> ChunkingFigures {
    let zstd_level = match compression {
        Compression::Zstd(l) => l,
        _ => 3,
    };
    let selected = Codec::of(compression);
    let n = images.len();
    // The analysis counted these images, and each has a name.
    debug_assert_eq!(a.images.len(), n);
    debug_assert_eq!(names.len(), n);
    let stored = Stored::new(&a.chunks);
    let per = PerImage::count(a, &stored, n);
    let (sharing_bytes, shared_physical) = sharing(a, &stored, selected, n);
    let sharing_percent: Vec<Vec<f64>> = sharing_bytes
        .iter()
        .zip(&a.images)
        .map(|(row, acc)| {
            row.iter()
                .map(|&b| percent(b as f64, acc.nonzero_bytes as f64))
                .collect()
        })
        .collect();

    let image_figures: Vec<ImageFigures> = images
        .iter()
        .zip(&a.images)
        .enumerate()
        .map(|(i, (img, acc))| {
            let t = image_tally(i, img, acc, &per, &names[i]);
            ImageFigures {
                name: names[i].clone(),
                path: img.path.display().to_string(),
                format: img.checked.format.name().to_string(),
                file_bytes: img.file_bytes,
                figures: figures(&t, selected, zstd_level, &stored),
                new_chunks: per.new_chunks[i],
                new_bytes: per.new_bytes[i],
                shared_physical_bytes: to_u64(shared_physical[i]),
            }
        })
        .collect();

    let total = total_tally(a, images, names, &per);
    let total_figures = figures(&total, selected, zstd_level, &stored);
    let delta = a.delta.as_ref().map(|d| {
        delta_figures(
            d,
            (&total, &total_figures, &per),
            selected,
            zstd_level,
            &stored,
        )
    });
    let index = index_figures(a, total, &total_figures, &stored, selected, zstd_level);
    ChunkingFigures {
        chunking: a.chunking.label(),
        chunk_bytes: a.chunking.chunk_bytes(),
        total: total_figures,
        images: image_figures,
        sharing: Sharing {
            images: names.to_vec(),
            bytes: sharing_bytes,
            percent: sharing_percent,
        },
        index,
        delta,
    }
}

/// The delta figures: the total pool projected again with the replay's payload bytes, alone
/// and with deltas, for the selected codec (each import's records as the replay stored them).
fn delta_figures(
    d: &DeltaRun,
    (total, dense, per): (&Tally, &Figures, &PerImage),
    selected: Codec,
    zstd_level: i8,
    stored: &Stored,
) -> DeltaFigures {
    let project = |bytes: &dyn Fn(&(u64, u64)) -> u64| -> Figures {
        let mut t = total.clone();
        let k = selected.index();
        t.stored[k] = d.stored.iter().map(bytes).sum::<u64>() as f64;
        t.record_bytes_per_import[k] = d
            .stored
            .iter()
            .zip(&per.new_chunks)
            .map(|(s, &n)| to_u64(n as f64 * RECORD) + bytes(s))
            .collect();
        figures(&t, selected, zstd_level, stored)
    };
    let (with, without) = (project(&|s| s.0), project(&|s| s.1));
    let totals = d.replay.totals();
    let sketch = d.replay.ram_bytes();
    DeltaFigures {
        codec: dense
            .codecs
            .get(selected.index())
            .map_or_else(String::new, |c| c.codec.clone()),
        stored_bytes_without: without.stored_bytes,
        stored_bytes: with.stored_bytes,
        delta_chunks: totals.deltas,
        saved_bytes: totals.saved_bytes,
        delta_saving_percent: percent(totals.saved_bytes as f64, without.stored_bytes as f64),
        projected_physical_bytes_without: without.projected_physical_bytes,
        projected_physical_bytes: with.projected_physical_bytes,
        projected_saving_percent: with.projected_saving_percent,
        sketch_index_bytes: sketch,
        sketch_index_bytes_per_unique_chunk: if dense.unique_chunks == 0 {
            0.0
        } else {
            round2(sketch as f64 / dense.unique_chunks as f64)
        },
        index_ram_bytes: dense.index_ram_bytes + sketch,
        sketch_lookups: totals.lookups,
        sketch_hits: totals.hits,
    }
}
