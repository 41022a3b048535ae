//! What a pool would take on disk and in RAM for a given set of chunks: the formula behind
//! `condense estimate`, kept next to the format it models (see `docs/FORMAT.md`) so that the
//! two change together.
//!
//! The data side is exact given the chunks: each unique chunk is one record (32-byte header +
//! its payload as [`condense_format::reduction::compress`] returns it), segments have a 64-byte header
//! and are sealed near the segment size target, and every `condense import` opens a segment of
//! its own. The metadata side models the state after a clean close: superblock, an empty
//! journal (its header), a small checkpoint root, and `meta.dat`: its header, the chunk-table
//! pages and the block-map pages with the interior pages above them, each stored compressed
//! (see [`META_BYTES_PER_CHUNK_PAGE`], [`META_BYTES_PER_MAP_PAGE`], [`META_BYTES_PER_BREAK`]).
//! `meta.dat` also keeps, until they are reused, the old copies of the pages the last
//! checkpoint rewrote; the projection counts live pages only, so a small pool may show a few
//! tens of KiB more than projected.
//!
//! RAM follows the in-memory layouts: the dense dedup index at 6 bytes a slot (82 % mean
//! load), the sparse one at its budget; the page cache is bounded by its budget and is not
//! counted per chunk.

use crate::index::IndexSetting;
use condense_format::{
    CHUNKS_PER_PAGE, JOURNAL_HEADER_BYTES, RECORD_HEADER_BYTES, ROOT_HEADER_BYTES,
    SEGMENT_HEADER_BYTES, SUPERBLOCK_BYTES,
};

/// Bytes `meta.dat` spends per full chunk-table page (128 records) on disk: the 16-byte
/// fingerprints do not compress, location and reference count do, mostly. Measured with
/// `encode_page` on pages of random fingerprints and 2000–6000-byte records: 2496–3136.
pub const META_BYTES_PER_CHUNK_PAGE: f64 = 3072.0;
/// Bytes `meta.dat` spends per block-map page (512 entries) whose ids run on (one 64-byte unit).
pub const META_BYTES_PER_MAP_PAGE: f64 = 64.0;
/// Extra bytes per block-map entry that breaks the run (an id that is not the previous + 1).
/// Measured with `encode_page`: 10–200 breaks in a page cost 6–7 bytes each.
pub const META_BYTES_PER_BREAK: f64 = 6.5;
/// Bytes per interior page, plus [`META_BYTES_PER_CHILD`] for each page it points to.
pub const META_BYTES_PER_INTERIOR: f64 = 64.0;
/// Bytes per child pointer in an interior page (unit number runs on, the CRC does not compress).
pub const META_BYTES_PER_CHILD: f64 = 8.0;

/// Segment size target of a pool made by `condense init` (64 MiB).
pub const DEFAULT_SEGMENT_BYTES: u64 = 64 << 20;

/// Checkpoint bytes per unique chunk (28-byte slot after zstd level 1).
pub const CHUNK_TABLE_BYTES_PER_CHUNK: f64 = 23.1;
/// Checkpoint bytes per block-map page (its page number; runs of equal deltas cost ~nothing).
pub const MAP_BYTES_PER_PAGE: f64 = 4.0;
/// Checkpoint bytes per block-map entry whose delta from the previous entry differs from the
/// previous delta. Fitted on the corpus (3019 pages, 120669 such entries: 309816 bytes) and on
/// three of its images (900 pages, 31200 entries: 77698 bytes).
pub const MAP_BYTES_PER_BREAK: f64 = 2.5;

/// The chunks a set of images would leave in a pool.
#[derive(Clone, Debug, Default)]
pub struct ProjectionInput {
    /// Unique (non-zero) chunks, each stored once.
    pub unique_chunks: u64,
    /// Sum of their stored payload lengths (compressed, or raw where that saved < 1/8).
    pub stored_payload_bytes: u64,
    /// Record bytes (headers + payloads) that each `condense import` adds, in import order:
    /// every import opens a new segment.
    pub record_bytes_per_import: Vec<u64>,
    /// Block-map pages (512 entries each) that hold at least one written entry, all volumes.
    pub map_pages: u64,
    /// Block-map entries that are not the previous entry's chunk id + 1 (where delta coding
    /// does not collapse a run), all volumes.
    pub map_breaks: u64,
    /// Number of volumes, and the bytes of their names.
    pub volumes: u64,
    pub volume_name_bytes: u64,
    /// Segment size target of the pool.
    pub segment_bytes: u64,
    /// The pool's dedup index: dense saves a file of it at a clean close (`dedup.idx`) and
    /// takes RAM per chunk; sparse saves none and takes its budget.
    pub index: IndexSetting,
}

/// Projected bytes on disk (as `condense stats --json` counts them) and RAM.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Projection {
    /// Segment files: headers and records.
    pub data_bytes: u64,
    /// Superblock and checkpoint root (two copies each), journal header, `meta.dat` and the
    /// dedup index a clean close saves (`dedup.idx`).
    pub metadata_bytes: u64,
    /// `data_bytes + metadata_bytes`: what `physical_bytes` will show.
    pub physical_bytes: u64,
    /// What `index_ram_bytes` will show: chunk table, dedup index, block maps.
    pub index_ram_bytes: u64,
}

/// The projection formula: bytes on disk and RAM of a pool holding exactly these chunks.
pub fn project(p: &ProjectionInput) -> Projection {
    let seg_target = p.segment_bytes.max(SEGMENT_HEADER_BYTES as u64 + 1);
    let room = seg_target - SEGMENT_HEADER_BYTES as u64;
    let segments: u64 = p
        .record_bytes_per_import
        .iter()
        .map(|&b| b.div_ceil(room))
        .sum();
    let records = p.unique_chunks * RECORD_HEADER_BYTES as u64 + p.stored_payload_bytes;
    let data_bytes = segments * SEGMENT_HEADER_BYTES as u64 + records;

    let chunk_pages = p.unique_chunks.div_ceil(CHUNKS_PER_PAGE as u64);
    let leaves = chunk_pages + p.map_pages;
    let interior = leaves.div_ceil(256) + p.volumes + 1;
    let map_bytes = (p.map_pages as f64 * META_BYTES_PER_MAP_PAGE
        + p.map_breaks as f64 * META_BYTES_PER_BREAK)
        .min(p.map_pages as f64 * crate::page_cache::PAGE_BYTES as f64);
    let meta_file = (crate::page_alloc::HEADER_UNITS as usize * crate::page_cache::UNIT) as f64
        + chunk_pages as f64 * META_BYTES_PER_CHUNK_PAGE
        + map_bytes
        + interior as f64 * META_BYTES_PER_INTERIOR
        + (leaves + p.volumes + 1) as f64 * META_BYTES_PER_CHILD;
    let root = ROOT_HEADER_BYTES as f64 + 64.0 + (p.volumes * 40 + p.volume_name_bytes) as f64;
    // The superblock and the root are each kept twice (condense_store::copies).
    // The dedup index: its saved file and its RAM (the page cache is a fixed budget, not
    // per chunk).
    let (index_file, index) = match p.index {
        IndexSetting::Dense => (
            crate::dedup_index::projected_file_bytes(p.unique_chunks),
            crate::dedup_index::projected_ram_bytes(p.unique_chunks),
        ),
        IndexSetting::Sparse { budget } => (0, crate::sparse_index::projected_ram_bytes(budget)),
    };
    let metadata_bytes = (2 * SUPERBLOCK_BYTES + JOURNAL_HEADER_BYTES) as u64
        + (2.0 * root + meta_file) as u64
        + index_file;
    Projection {
        data_bytes,
        metadata_bytes,
        physical_bytes: data_bytes + metadata_bytes,
        index_ram_bytes: index,
    }
}

/// 100 × (1 − physical / written): `saving_percent` of `condense stats`.
pub fn saving_percent(physical: u64, written: u64) -> f64 {
    if written == 0 {
        0.0
    } else {
        100.0 * (1.0 - physical as f64 / written as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_pool_is_only_fixed_metadata() {
        let p = project(&ProjectionInput {
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            ..Default::default()
        });
        assert_eq!(p.data_bytes, 0);
        assert!(p.metadata_bytes > 128 + 64 && p.metadata_bytes < 16384);
        // The index's fixed part only (its 4096 empty shards).
        assert!(p.index_ram_bytes < 512 << 10);
    }

    #[test]
    fn segments_per_import_and_records() {
        let room = DEFAULT_SEGMENT_BYTES - 64;
        let p = project(&ProjectionInput {
            unique_chunks: 10,
            stored_payload_bytes: 1000,
            record_bytes_per_import: vec![room + 1, 5],
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            ..Default::default()
        });
        // Two segments for the first import, one for the second.
        assert_eq!(p.data_bytes, 3 * 64 + 10 * 32 + 1000);
    }

    #[test]
    fn a_sparse_index_saves_no_file_and_takes_its_budget() {
        let input = |index| ProjectionInput {
            unique_chunks: 1_000_000,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            index,
            ..Default::default()
        };
        let dense = project(&input(IndexSetting::Dense));
        let sparse = project(&input(IndexSetting::Sparse { budget: 1 << 20 }));
        assert_eq!(
            dense.metadata_bytes - sparse.metadata_bytes,
            crate::dedup_index::projected_file_bytes(1_000_000)
        );
        assert_eq!(
            sparse.index_ram_bytes,
            crate::sparse_index::projected_ram_bytes(1 << 20)
        );
        assert!(sparse.index_ram_bytes <= 1 << 20);
        assert!(dense.index_ram_bytes > 6_000_000);
    }

    #[test]
    fn ram_matches_engine_layout() {
        // 329583 chunks, 900 map pages: what `condense stats` reported for three corpus images.
        let p = project(&ProjectionInput {
            unique_chunks: 329_583,
            map_pages: 900,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            ..Default::default()
        });
        let per = p.index_ram_bytes as f64 / 329_583.0;
        assert!(per > 6.0 && per < 9.0, "{per} bytes per chunk");
    }
}
