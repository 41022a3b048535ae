//! Volume handles: the Volume API over the pool, and the pool as a Catalog (a room of the
//! pool: [`Pool::volume`] opens a handle).
//!
//! Owns: turning byte ranges into whole-block operations. Partial blocks at the edges of a
//! write are read, patched and written whole under the volume's write lock, so concurrent
//! writes to different bytes of one block never lose each other. Each read, write and
//! zeroing is counted, with its latency, in the name's [`VolumeIo`] (a few relaxed atomic
//! adds: [`crate::volume_counters`]).

use super::Pool;
use crate::error::{Error, Result};
use crate::format::{ENTRY_UNMAPPED, ENTRY_ZERO};
use crate::volume_counters::{Reduced, VolumeIo};
use condense_api::{Extent, ExtentKind, VolumeError};
use std::sync::Arc;
use std::time::Instant;

/// An open volume.
pub struct VolumeHandle {
    pool: Arc<Pool>,
    vol: u32,
    name: String,
    /// A snapshot, or a pool opened read-only. Writable handles are counted in
    /// `Pool::writers` while they live.
    read_only: bool,
    /// The I/O counters of `name`, shared with its other handles.
    io: Arc<VolumeIo>,
}

impl Drop for VolumeHandle {
    fn drop(&mut self) {
        if !self.read_only {
            let mut w = crate::locks::lock(&self.pool.writers);
            if let Some(n) = w.get_mut(&self.vol) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    w.remove(&self.vol);
                }
            }
        }
    }
}

impl VolumeHandle {
    pub(crate) fn new(pool: Arc<Pool>, vol: u32, name: String, read_only: bool) -> VolumeHandle {
        let io = pool.volume_io_for(&name);
        VolumeHandle {
            pool,
            vol,
            name,
            read_only,
            io,
        }
    }

    /// `r`, counted as an error in the volume's I/O counters if it is one.
    fn counted<T>(&self, r: Result<T>) -> Result<T> {
        if r.is_err() {
            self.io.error();
        }
        r
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    fn bs(&self) -> u64 {
        u64::from(self.pool.block_size())
    }

    fn range(&self, op: &'static str, offset: u64, len: u64) -> Result<()> {
        let size = self.pool.volume_size(self.vol, &self.name)?;
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(Error::OutOfRange {
                op,
                volume: self.name.clone(),
                offset,
                len,
                size,
            }),
        }
    }

    /// `len` bytes at `offset` are whole blocks (at least one).
    fn whole_blocks(&self, offset: u64, len: usize) -> bool {
        let bs = self.bs();
        len > 0 && offset.is_multiple_of(bs) && (len as u64).is_multiple_of(bs)
    }

    pub fn size(&self) -> Result<u64> {
        self.pool.volume_size(self.vol, &self.name)
    }

    /// Read `buf.len()` bytes at `offset` (any alignment).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let started = Instant::now();
        let cache_use = self.counted(self.read_any(offset, buf))?;
        self.io.read(buf.len() as u64, started.elapsed(), cache_use);
        Ok(())
    }

    /// The extents of `[offset, offset + buf.len())`, with the data extents' bytes read into
    /// `buf` (see [`condense_api::Volume::read_sparse`]): counted as one read of the whole
    /// range, holes included, as [`VolumeHandle::read_at`] counts it.
    pub fn read_sparse_at(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<Extent>> {
        let started = Instant::now();
        let mut read = || -> Result<(Vec<Extent>, (u64, u64))> {
            let extents = self.extents(offset, buf.len() as u64)?;
            let mut cache_use = (0, 0);
            for e in extents.iter().filter(|e| e.kind == ExtentKind::Data) {
                // `extents` covers exactly the range read, in order.
                let at = (e.offset - offset) as usize;
                let Some(dst) = buf.get_mut(at..at + e.len as usize) else {
                    return Err(Error::corrupt(
                        "block map",
                        format!(
                            "extent {}+{} outside the read of volume {:?}",
                            e.offset, e.len, self.name
                        ),
                    ));
                };
                let (h, m) = self.read_any(e.offset, dst)?;
                cache_use = (cache_use.0 + h, cache_use.1 + m);
            }
            Ok((extents, cache_use))
        };
        let (extents, cache_use) = self.counted(read())?;
        self.io.read(buf.len() as u64, started.elapsed(), cache_use);
        Ok(extents)
    }

    /// [`VolumeHandle::read_at`], uncounted; returns the cache tier's hits and misses.
    fn read_any(&self, offset: u64, buf: &mut [u8]) -> Result<(u64, u64)> {
        let bs = self.bs();
        if self.whole_blocks(offset, buf.len()) {
            // read_blocks checks the range under the pool's lock (one lock taken, not two).
            return self
                .pool
                .read_blocks(self.vol, &self.name, offset / bs, buf);
        }
        self.range("read", offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok((0, 0));
        }
        let first = offset / bs;
        let end = offset + buf.len() as u64;
        let last = end.div_ceil(bs);
        let mut tmp = vec![0u8; ((last - first) * bs) as usize];
        let cache_use = self
            .pool
            .read_blocks(self.vol, &self.name, first, &mut tmp)?;
        let at = (offset - first * bs) as usize;
        buf.copy_from_slice(&tmp[at..at + buf.len()]);
        Ok(cache_use)
    }

    /// Write `data` at `offset` (any alignment); durable on return with `fua` or in sync mode.
    pub fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let started = Instant::now();
        let reduced = self.counted(self.write_any(offset, data, fua))?;
        self.io.write(data.len() as u64, started.elapsed(), reduced);
        Ok(())
    }

    /// [`VolumeHandle::write_at`], uncounted; returns what became of the blocks written.
    fn write_any(&self, offset: u64, data: &[u8], fua: bool) -> Result<Reduced> {
        let bs = self.bs();
        let (seq, reduced) = if self.whole_blocks(offset, data.len()) {
            // Whole blocks need no volume lock: concurrent writers hash and compress in
            // parallel and commit under the pool's state lock, which also checks the range.
            // (A write overlapping another in flight may land before or after it, as on any
            // disk.)
            self.pool
                .write_blocks(self.vol, &self.name, offset / bs, data)?
        } else {
            self.range("write", offset, data.len() as u64)?;
            if data.is_empty() {
                return Ok(Reduced::default());
            }
            let first = offset / bs;
            let end = offset + data.len() as u64;
            let last = end.div_ceil(bs);
            // Partial blocks: read, patch and write under the volume's lock, so two writes
            // to different bytes of one block never lose each other.
            let lock = self.pool.volume_lock(self.vol);
            let _w = crate::locks::lock(&lock);
            // Read the edge blocks, patch, write whole blocks.
            let mut tmp = vec![0u8; ((last - first) * bs) as usize];
            let bsu = bs as usize;
            self.pool
                .read_blocks(self.vol, &self.name, first, &mut tmp[..bsu])?;
            if last - first > 1 {
                let tail = tmp.len() - bsu;
                self.pool
                    .read_blocks(self.vol, &self.name, last - 1, &mut tmp[tail..])?;
            }
            let at = (offset - first * bs) as usize;
            tmp[at..at + data.len()].copy_from_slice(data);
            self.pool.write_blocks(self.vol, &self.name, first, &tmp)?
        };
        self.finish(seq, fua)?;
        Ok(reduced)
    }

    fn finish(&self, seq: u64, fua: bool) -> Result<()> {
        if fua || self.pool.sync_writes() {
            self.pool.flush_through(seq)?;
        } else if self.pool.take_journal_full() {
            // The journal passed its size with no flush: this one checkpoints it, so a crash
            // replays at most that much at the next open. The write itself did not ask for a
            // flush, so one that fails (an object store away) does not fail it: the next
            // flush, or the next time the journal grows by its size, tries again.
            if let Err(e) = self.pool.flush() {
                tracing::warn!(
                    "volume {}: flushing the journal past its size failed: {e}",
                    self.name
                );
            }
        }
        Ok(())
    }

    /// Zero a range: whole blocks become ZERO (or UNMAPPED with `may_unmap`); partial edge
    /// blocks are patched with zeros.
    pub fn zero_at(&self, offset: u64, len: u64, may_unmap: bool, fua: bool) -> Result<()> {
        let started = Instant::now();
        let reduced = self.counted(self.zero_any(offset, len, may_unmap, fua))?;
        self.io.zero(len, started.elapsed(), reduced);
        Ok(())
    }

    /// [`VolumeHandle::zero_at`], uncounted; returns what became of the edge blocks
    /// rewritten.
    fn zero_any(&self, offset: u64, len: u64, may_unmap: bool, fua: bool) -> Result<Reduced> {
        self.range("write_zeroes", offset, len)?;
        let mut reduced = Reduced::default();
        if len == 0 {
            return Ok(reduced);
        }
        let bs = self.bs();
        let end = offset + len;
        let full_first = offset.div_ceil(bs);
        let full_end = end / bs;
        let lock = self.pool.volume_lock(self.vol);
        let _w = crate::locks::lock(&lock);
        let mut seq = 0;
        let entry = if may_unmap {
            ENTRY_UNMAPPED
        } else {
            ENTRY_ZERO
        };
        if full_first < full_end {
            seq = self.pool.fill_blocks(
                self.vol,
                &self.name,
                full_first,
                full_end - full_first,
                entry,
            )?;
        }
        // Partial blocks at either edge (or one block holding the whole range).
        let mut edges = Vec::new();
        if full_first > full_end {
            edges.push((offset, end));
        } else {
            if !offset.is_multiple_of(bs) {
                edges.push((offset, full_first * bs));
            }
            if !end.is_multiple_of(bs) && full_end * bs >= offset {
                edges.push((full_end * bs, end));
            }
        }
        for (s, e) in edges {
            let block = s / bs;
            if self
                .pool
                .map_entries(self.vol, &self.name, block, 1)?
                .is_empty()
            {
                continue; // an unmapped block already reads zeros
            }
            let mut tmp = vec![0u8; bs as usize];
            self.pool
                .read_blocks(self.vol, &self.name, block, &mut tmp)?;
            tmp[(s - block * bs) as usize..(e - block * bs) as usize].fill(0);
            let (edge_seq, edge) = self.pool.write_blocks(self.vol, &self.name, block, &tmp)?;
            seq = edge_seq;
            reduced.add(edge);
        }
        self.finish(seq, fua)?;
        Ok(reduced)
    }

    /// Extents of `[offset, offset+len)`.
    pub fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.range("block_status", offset, len)?;
        let bs = self.bs();
        let first = offset / bs;
        let last = (offset + len).div_ceil(bs);
        let mapped = self
            .pool
            .map_entries(self.vol, &self.name, first, last - first)?;
        let mut out = Vec::new();
        let mut pos = offset;
        let end = offset + len;
        for (block, e) in mapped {
            let bstart = (block * bs).max(offset);
            if bstart > pos {
                condense_api::mem::push_extent(&mut out, pos, bstart - pos, ExtentKind::Unmapped);
            }
            let bend = ((block + 1) * bs).min(end);
            let kind = if e == ENTRY_ZERO {
                ExtentKind::Zero
            } else {
                ExtentKind::Data
            };
            condense_api::mem::push_extent(&mut out, bstart, bend - bstart, kind);
            pos = bend;
        }
        if pos < end {
            condense_api::mem::push_extent(&mut out, pos, end - pos, ExtentKind::Unmapped);
        }
        Ok(out)
    }
}

impl condense_api::Volume for VolumeHandle {
    fn name(&self) -> &str {
        &self.name
    }
    fn size(&self) -> u64 {
        self.pool.volume_size(self.vol, &self.name).unwrap_or(0)
    }
    fn block_size(&self) -> u32 {
        self.pool.block_size()
    }
    fn is_read_only(&self) -> bool {
        self.read_only
    }
    fn flush_is_pool_wide(&self) -> bool {
        true
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> condense_api::Result<()> {
        Ok(self.read_at(offset, buf)?)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> condense_api::Result<()> {
        Ok(self.write_at(offset, data, fua)?)
    }
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
        fua: bool,
    ) -> condense_api::Result<()> {
        Ok(self.zero_at(offset, len, may_unmap, fua)?)
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> condense_api::Result<()> {
        Ok(self.zero_at(offset, len, true, fua)?)
    }
    fn flush(&self) -> condense_api::Result<()> {
        Ok(self.pool.flush()?)
    }
    fn block_status(&self, offset: u64, len: u64) -> condense_api::Result<Vec<Extent>> {
        Ok(self.extents(offset, len)?)
    }
    fn read_sparse(&self, offset: u64, buf: &mut [u8]) -> condense_api::Result<Vec<Extent>> {
        Ok(self.read_sparse_at(offset, buf)?)
    }
    fn physical_bytes(&self) -> Option<u64> {
        self.pool.volume_physical_bytes(&self.name).ok()
    }
    fn snapshot_names(&self) -> condense_api::Result<Vec<String>> {
        Ok(self
            .pool
            .snapshot_list()
            .into_iter()
            .filter(|s| s.volume == self.name)
            .map(|s| s.snapshot)
            .collect())
    }
    fn changed_since(
        &self,
        snapshot: &str,
        offset: u64,
        len: u64,
    ) -> condense_api::Result<Vec<condense_api::Change>> {
        self.range("block_status", offset, len)?;
        let from = format!("{}@{snapshot}", self.name);
        Ok(self.pool.diff_bytes(&from, &self.name, offset, len)?)
    }
}

impl condense_api::Catalog for Pool {
    fn list(&self) -> condense_api::Result<Vec<condense_api::VolumeInfo>> {
        Ok(self.volume_infos())
    }
    fn open(&self, name: &str) -> condense_api::Result<Arc<dyn condense_api::Volume>> {
        Ok(Arc::new(self.volume(name)?))
    }
    fn create(&self, name: &str, size_bytes: u64) -> condense_api::Result<()> {
        Ok(self.create_volume(name, size_bytes)?)
    }
    fn delete(&self, name: &str) -> condense_api::Result<()> {
        Ok(self.delete_volume(name)?)
    }
    fn resize(&self, name: &str, size_bytes: u64, force: bool) -> condense_api::Result<()> {
        Ok(self.resize_volume(name, size_bytes, force)?)
    }
    fn usage(&self) -> condense_api::Result<condense_api::PoolUsage> {
        let physical_bytes = self
            .dir()
            .total_bytes()
            .map_err(|e| VolumeError::Io(e.to_string()))?;
        let available_bytes = self
            .dir()
            .available_bytes()
            .map_err(|e| VolumeError::Io(e.to_string()))?;
        Ok(condense_api::PoolUsage {
            physical_bytes,
            available_bytes,
            logical_bytes: self.volumes().iter().map(|(_, s)| s).sum(),
            block_size: self.block_size(),
        })
    }
    fn flush(&self) -> condense_api::Result<()> {
        Ok(Pool::flush(self)?)
    }
    fn snapshots(&self) -> condense_api::Result<Vec<condense_api::SnapshotInfo>> {
        let bs = u64::from(self.block_size());
        Ok(self
            .snapshot_list()
            .into_iter()
            .map(|s| condense_api::SnapshotInfo {
                volume: s.volume,
                snapshot: s.snapshot,
                created_unix: s.created_unix,
                size_bytes: s.size_bytes,
                written_bytes: s.data_blocks * bs,
            })
            .collect())
    }
    fn snapshot_create(&self, volume: &str, snapshot: &str) -> condense_api::Result<()> {
        Ok(self.create_snapshot(volume, snapshot)?)
    }
    fn snapshot_delete(&self, volume: &str, snapshot: &str) -> condense_api::Result<()> {
        Ok(self.delete_snapshot(volume, snapshot)?)
    }
    fn clone_volume(&self, source: &str, new: &str) -> condense_api::Result<()> {
        Ok(Pool::clone_volume(self, source, new)?)
    }
    fn snapshot_freeable_bytes(
        &self,
        volume: &str,
        snapshot: &str,
    ) -> condense_api::Result<Option<u64>> {
        Ok(Some(Pool::snapshot_freeable_bytes(self, volume, snapshot)?))
    }
    fn rollback(&self, volume: &str, snapshot: &str, force: bool) -> condense_api::Result<()> {
        Ok(self.rollback_volume(volume, snapshot, force)?)
    }
    fn diff(
        &self,
        from: &str,
        to: &str,
        offset: u64,
        len: u64,
    ) -> condense_api::Result<Vec<condense_api::Change>> {
        let size = self.volume_size_any(from)?.max(self.volume_size_any(to)?);
        condense_api::check_range("diff", to, offset, len, size)?;
        Ok(self.diff_bytes(from, to, offset, len)?)
    }
    fn meta_get(&self, key: &str) -> condense_api::Result<Option<Vec<u8>>> {
        Ok(Pool::meta_get(self, key))
    }
    fn meta_put(&self, key: &str, value: Option<&[u8]>) -> condense_api::Result<()> {
        Ok(Pool::meta_put(self, key, value)?)
    }
}
