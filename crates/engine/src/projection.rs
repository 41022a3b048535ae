//! What a pool would take on disk and in RAM for a given set of chunks: the formula behind
//! `condense estimate`, kept next to the format it models (see `docs/FORMAT.md`) so that the
//! two change together.
//!
//! The data side is exact given the chunks: each unique chunk is one record (32-byte header +
//! its payload as [`crate::reduction::compress`] returns it), segments have a 64-byte header
//! and are sealed near the segment size target, and every `condense import` opens a segment of
//! its own. The metadata side models the state after a clean close: superblock, an empty
//! journal (its header) and one checkpoint whose sections are zstd-compressed. Two sections
//! hold nearly all of it:
//! - the chunk table, 28 bytes a chunk before zstd, of which the 16-byte fingerprint does not
//!   compress (measured: 23.1 bytes a chunk after zstd on the corpus and on generated images);
//! - the block maps, 1024 delta-coded entries a page: a run of sequential chunk ids (or of
//!   zeros, or of holes) costs almost nothing, every entry where the delta changes (a
//!   duplicate pointing back, the edge of a hole) ~2.5 bytes (calibrated against
//!   `condense import` + the checkpoint's section sizes).
//!
//! RAM follows the in-memory layouts: the chunk table in pages of 4096 slots of 32 bytes, the
//! dedup index as a hash table of 4-byte ids with one control byte a slot (7/8 load), and
//! block-map pages of 1024 entries of 4 bytes plus ~48 bytes of tree node each.

use crate::format::{
    CHECKPOINT_HEADER_BYTES, CHUNKS_PER_SECTION, JOURNAL_HEADER_BYTES, MAP_PAGE_ENTRIES,
    RECORD_HEADER_BYTES, SECTION_HEADER_BYTES, SEGMENT_HEADER_BYTES, SUPERBLOCK_BYTES,
};

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
    /// Block-map pages (1024 entries each) that hold at least one written entry, all volumes.
    pub map_pages: u64,
    /// Block-map entries that are not the previous entry's chunk id + 1 (where delta coding
    /// does not collapse a run), all volumes.
    pub map_breaks: u64,
    /// Number of volumes, and the bytes of their names.
    pub volumes: u64,
    pub volume_name_bytes: u64,
    /// Segment size target of the pool.
    pub segment_bytes: u64,
}

/// Projected bytes on disk (as `condense stats --json` counts them) and RAM.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Projection {
    /// Segment files: headers and records.
    pub data_bytes: u64,
    /// Superblock, journal header and checkpoint.
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

    let sections = 1 /* volumes */ + p.volumes + p.unique_chunks.div_ceil(CHUNKS_PER_SECTION as u64) + 1 /* meta */;
    let checkpoint = CHECKPOINT_HEADER_BYTES as f64
        + (sections * SECTION_HEADER_BYTES as u64) as f64
        + 24.0 /* volume list and empty metadata records after zstd */
        + (p.volumes * 8 + p.volume_name_bytes) as f64
        + p.volumes as f64 * 12.0 /* a map section's count and zstd frame */
        + p.unique_chunks as f64 * CHUNK_TABLE_BYTES_PER_CHUNK
        + p.map_pages as f64 * MAP_BYTES_PER_PAGE
        + p.map_breaks as f64 * MAP_BYTES_PER_BREAK;
    let metadata_bytes = (SUPERBLOCK_BYTES + JOURNAL_HEADER_BYTES) as u64 + checkpoint as u64;

    // RAM, as the engine's structures allocate it.
    let chunk_table = p.unique_chunks.div_ceil(4096) * 4096 * 32;
    let index = hash_table_capacity(p.unique_chunks) * 5;
    let maps = p.map_pages * (MAP_PAGE_ENTRIES as u64 * 4 + 48);
    Projection {
        data_bytes,
        metadata_bytes,
        physical_bytes: data_bytes + metadata_bytes,
        index_ram_bytes: chunk_table + index + maps,
    }
}

/// Slots of a hashbrown table grown one insert at a time to `n` items.
fn hash_table_capacity(n: u64) -> u64 {
    if n == 0 {
        return 0;
    }
    if n < 4 {
        return 3;
    }
    if n < 8 {
        return 7;
    }
    let buckets = (n * 8).div_ceil(7).next_power_of_two();
    buckets / 8 * 7
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
        assert!(p.metadata_bytes > 128 + 64 && p.metadata_bytes < 512);
        assert_eq!(p.index_ram_bytes, 0);
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
    fn ram_matches_engine_layout() {
        // 329583 chunks, 900 map pages: what `condense stats` reported for three corpus images.
        let p = project(&ProjectionInput {
            unique_chunks: 329_583,
            map_pages: 900,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            ..Default::default()
        });
        assert_eq!(p.index_ram_bytes, 16_640_192);
    }
}
