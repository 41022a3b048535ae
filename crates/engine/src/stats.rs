//! `condense stats`: how much the pool saves, per pool and per volume.
//!
//! Definitions (also in docs/STATS.md):
//! - `written_bytes`: blocks holding data (not zero, not unmapped) × block size.
//! - `physical_bytes`: every file of the pool directory (data and metadata), as `du -sb`.
//! - `saving_percent` = 100 × (1 − physical_bytes / written_bytes).
//! - `dedup_saving_percent` = 100 × (1 − unique_chunks × block size / written_bytes).
//! - `compression_saving_percent` = 100 × (1 − stored payload bytes / (unique_chunks × block size)).
//! - A volume's `physical_bytes` is its share: each block counts its chunk's record bytes
//!   divided by the number of blocks sharing that chunk.

use crate::error::{Error, Result};
use crate::format::{CHUNK_ID_LIMIT, SEGMENT_HEADER_BYTES};
use crate::pool::{lock, Pool, State, VolumeState};
use std::collections::HashSet;

#[derive(Clone, Debug, Default)]
pub struct VolumeStats {
    pub name: String,
    pub logical_bytes: u64,
    pub written_bytes: u64,
    pub zero_bytes: u64,
    pub unique_chunks: u64,
    pub physical_bytes: u64,
    pub saving_percent: f64,
    pub damaged: bool,
}

#[derive(Clone, Debug, Default)]
pub struct PoolStats {
    pub block_size: u32,
    pub logical_bytes: u64,
    pub written_bytes: u64,
    pub zero_bytes: u64,
    pub unique_chunks: u64,
    /// Payload bytes of live chunks after compression.
    pub stored_bytes: u64,
    pub data_bytes: u64,
    pub metadata_bytes: u64,
    pub physical_bytes: u64,
    pub dead_bytes: u64,
    pub segments: u64,
    pub dedup_saving_percent: f64,
    pub compression_saving_percent: f64,
    pub saving_percent: f64,
    /// RAM held by the dedup index, chunk table and block maps.
    pub index_ram_bytes: u64,
    pub ram_bytes_per_unique_chunk: f64,
    pub read_errors: u64,
    pub volumes: Vec<VolumeStats>,
}

pub(crate) fn percent_saved(used: u64, of: u64) -> f64 {
    if of == 0 {
        0.0
    } else {
        100.0 * (1.0 - used as f64 / of as f64)
    }
}

/// A volume's distinct chunks and its share of the pool's data bytes: each block counts its
/// chunk's record bytes divided by the number of blocks sharing that chunk.
pub(crate) fn volume_share(st: &State, v: &VolumeState) -> (u64, f64) {
    let mut distinct = HashSet::new();
    let mut share = 0f64;
    for (_, e) in v.map.iter_from(0) {
        if e < CHUNK_ID_LIMIT {
            distinct.insert(e);
            if let Some((c, loc)) = st.chunks.get(e).and_then(|c| Some((c, c.location()?))) {
                share += loc.record_bytes() as f64 / f64::from(c.refs.max(1));
            }
        }
    }
    (distinct.len() as u64, share)
}

impl Pool {
    /// One volume's physical share in bytes (what `du` of it should show).
    pub fn volume_physical_bytes(&self, name: &str) -> Result<u64> {
        let st = lock(&self.state);
        let vol = st
            .names
            .get(name)
            .ok_or_else(|| Error::NotFound(name.to_string()))?;
        let v = st
            .volumes
            .get(vol)
            .ok_or_else(|| Error::NotFound(name.to_string()))?;
        Ok(volume_share(&st, v).1 as u64)
    }

    pub fn stats(&self) -> Result<PoolStats> {
        let physical = self
            .dir()
            .total_bytes()
            .map_err(|e| Error::io("measuring the pool directory", e))?;
        let st = lock(&self.state);
        let bs = u64::from(self.block_size());
        let mut s = PoolStats {
            block_size: self.block_size(),
            ..Default::default()
        };
        let mut ram = st.chunks.ram_bytes() + st.index.ram_bytes();
        for v in st.volumes.values() {
            let (distinct, share) = volume_share(&st, v);
            ram += v.map.ram_bytes();
            let written = v.map.data_blocks() * bs;
            s.volumes.push(VolumeStats {
                name: v.name.clone(),
                logical_bytes: v.size,
                written_bytes: written,
                zero_bytes: v.map.zero_blocks() * bs,
                unique_chunks: distinct,
                physical_bytes: share as u64,
                saving_percent: percent_saved(share as u64, written),
                damaged: v.damaged.is_some(),
            });
            s.logical_bytes += v.size;
            s.written_bytes += written;
            s.zero_bytes += v.map.zero_blocks() * bs;
        }
        s.volumes.sort_by(|a, b| a.name.cmp(&b.name));
        s.unique_chunks = st.chunks.live_chunks();
        s.stored_bytes = st.chunks.live_stored_bytes();
        s.data_bytes = st.segments.total_bytes();
        s.segments = st.segments.ids().count() as u64;
        s.dead_bytes = st
            .segments
            .ids()
            .map(|(id, len)| {
                len.saturating_sub(SEGMENT_HEADER_BYTES as u64 + st.chunks.segment_live_bytes(id))
            })
            .sum();
        s.physical_bytes = physical;
        s.metadata_bytes = physical.saturating_sub(s.data_bytes);
        s.dedup_saving_percent = percent_saved(s.unique_chunks * bs, s.written_bytes);
        s.compression_saving_percent = percent_saved(s.stored_bytes, s.unique_chunks * bs);
        s.saving_percent = percent_saved(s.physical_bytes, s.written_bytes);
        s.index_ram_bytes = ram;
        s.ram_bytes_per_unique_chunk = if s.unique_chunks == 0 {
            0.0
        } else {
            ram as f64 / s.unique_chunks as f64
        };
        s.read_errors = self.read_errors.load(std::sync::atomic::Ordering::Relaxed);
        Ok(s)
    }
}
