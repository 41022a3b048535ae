//! A plain in-memory implementation of the Volume API.
//!
//! It is deliberately simple (a map of block number to block content) so that it can serve as
//! the model that the engine is checked against, and as the store behind frontend unit tests.
//! It keeps everything in memory: `flush` does nothing and nothing survives the process.

use crate::{
    check_range, push_change, split_snapshot_name, Catalog, Change, Extent, ExtentKind, PoolUsage,
    Result, SnapshotInfo, Volume, VolumeError, VolumeInfo,
};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

/// What one block of a [`MemVolume`] holds. Absent from the map means unmapped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemBlock {
    Data(Vec<u8>),
    Zero,
}

#[derive(Debug, Default)]
struct MemVolumeState {
    size: u64,
    blocks: BTreeMap<u64, MemBlock>,
    deleted: bool,
    /// A snapshot (named `VOLUME@SNAPSHOT`): refuses writes.
    read_only: bool,
    /// Creation order among snapshots.
    order: u64,
}

impl MemVolumeState {
    /// Bytes in blocks that hold data.
    fn written_bytes(&self, block_size: u32) -> u64 {
        let data = self
            .blocks
            .values()
            .filter(|b| matches!(b, MemBlock::Data(_)))
            .count() as u64;
        data * u64::from(block_size)
    }
}

type Volumes = Arc<Mutex<HashMap<String, Arc<Mutex<MemVolumeState>>>>>;

/// One in-memory volume.
pub struct MemVolume {
    name: String,
    block_size: u32,
    state: Arc<Mutex<MemVolumeState>>,
    /// The catalog's volumes (to find this volume's snapshots).
    all: Volumes,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means another test thread panicked; the data is still usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl MemVolume {
    fn state(&self) -> Result<MutexGuard<'_, MemVolumeState>> {
        let s = lock(&self.state);
        if s.deleted {
            return Err(VolumeError::NotFound(self.name.clone()));
        }
        Ok(s)
    }

    fn writable(&self) -> Result<MutexGuard<'_, MemVolumeState>> {
        let s = self.state()?;
        if s.read_only {
            return Err(VolumeError::ReadOnly);
        }
        Ok(s)
    }

    /// The block map, for tests that compare extents.
    pub fn blocks(&self) -> BTreeMap<u64, MemBlock> {
        lock(&self.state).blocks.clone()
    }

    /// Apply `f(block, start_in_block, range_in_data)` over the blocks a byte range touches.
    fn for_blocks(&self, offset: u64, len: u64, mut f: impl FnMut(u64, usize, usize, usize)) {
        let bs = u64::from(self.block_size);
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let block = pos / bs;
            let in_block = (pos % bs) as usize;
            let n = ((bs - pos % bs).min(end - pos)) as usize;
            f(block, in_block, (pos - offset) as usize, n);
            pos += n as u64;
        }
    }
}

fn block_bytes(s: &MemVolumeState, block: u64, bs: usize) -> Vec<u8> {
    match s.blocks.get(&block) {
        Some(MemBlock::Data(d)) => d.clone(),
        _ => vec![0; bs],
    }
}

impl Volume for MemVolume {
    fn name(&self) -> &str {
        &self.name
    }
    fn size(&self) -> u64 {
        lock(&self.state).size
    }
    fn block_size(&self) -> u32 {
        self.block_size
    }
    fn is_read_only(&self) -> bool {
        lock(&self.state).read_only
    }
    fn flush_is_pool_wide(&self) -> bool {
        true
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let s = self.state()?;
        check_range("read", &self.name, offset, buf.len() as u64, s.size)?;
        let bs = self.block_size as usize;
        self.for_blocks(offset, buf.len() as u64, |block, at, pos, n| {
            let b = block_bytes(&s, block, bs);
            buf[pos..pos + n].copy_from_slice(&b[at..at + n]);
        });
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> Result<()> {
        let mut s = self.writable()?;
        check_range("write", &self.name, offset, data.len() as u64, s.size)?;
        let bs = self.block_size as usize;
        self.for_blocks(offset, data.len() as u64, |block, at, pos, n| {
            let mut b = block_bytes(&s, block, bs);
            b[at..at + n].copy_from_slice(&data[pos..pos + n]);
            let v = if b.iter().all(|&x| x == 0) {
                MemBlock::Zero
            } else {
                MemBlock::Data(b)
            };
            s.blocks.insert(block, v);
        });
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool, _fua: bool) -> Result<()> {
        let mut s = self.writable()?;
        check_range("write_zeroes", &self.name, offset, len, s.size)?;
        let bs = self.block_size as usize;
        self.for_blocks(offset, len, |block, at, _pos, n| {
            if n == bs {
                if may_unmap {
                    s.blocks.remove(&block);
                } else {
                    s.blocks.insert(block, MemBlock::Zero);
                }
            } else if s.blocks.contains_key(&block) {
                let mut b = block_bytes(&s, block, bs);
                b[at..at + n].fill(0);
                let v = if b.iter().all(|&x| x == 0) {
                    MemBlock::Zero
                } else {
                    MemBlock::Data(b)
                };
                s.blocks.insert(block, v);
            }
        });
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.write_zeroes(offset, len, true, fua)
    }

    fn flush(&self) -> Result<()> {
        self.state().map(|_| ())
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        let s = self.state()?;
        check_range("block_status", &self.name, offset, len, s.size)?;
        let mut out: Vec<Extent> = Vec::new();
        self.for_blocks(offset, len, |block, _at, pos, n| {
            let kind = match s.blocks.get(&block) {
                Some(MemBlock::Data(_)) => ExtentKind::Data,
                Some(MemBlock::Zero) => ExtentKind::Zero,
                None => ExtentKind::Unmapped,
            };
            push_extent(&mut out, offset + pos as u64, n as u64, kind);
        });
        Ok(out)
    }

    fn snapshot_names(&self) -> Result<Vec<String>> {
        let prefix = format!("{}@", self.name);
        let vols = lock(&self.all);
        let mut snaps: Vec<(u64, String)> = vols
            .iter()
            .filter_map(|(n, s)| Some((lock(s).order, n.strip_prefix(&prefix)?.to_string())))
            .collect();
        snaps.sort();
        Ok(snaps.into_iter().map(|(_, n)| n).collect())
    }

    fn changed_since(&self, snapshot: &str, offset: u64, len: u64) -> Result<Vec<Change>> {
        let snap_name = format!("{}@{snapshot}", self.name);
        let snap = lock(&self.all)
            .get(&snap_name)
            .cloned()
            .ok_or(VolumeError::NotFound(snap_name))?;
        let s = self.state()?;
        check_range("block_status", &self.name, offset, len, s.size)?;
        let snap = lock(&snap);
        let mut out = Vec::new();
        self.for_blocks(offset, len, |block, _at, pos, n| {
            let changed = s.blocks.get(&block) != snap.blocks.get(&block);
            push_change(&mut out, offset + pos as u64, n as u64, changed);
        });
        Ok(out)
    }
}

/// Append an extent, merging it with the previous one when adjacent and of the same kind.
pub fn push_extent(out: &mut Vec<Extent>, offset: u64, len: u64, kind: ExtentKind) {
    if let Some(last) = out.last_mut() {
        if last.kind == kind && last.offset + last.len == offset {
            last.len += len;
            return;
        }
    }
    out.push(Extent { offset, len, kind });
}

/// An in-memory pool of [`MemVolume`]s.
pub struct MemCatalog {
    block_size: u32,
    volumes: Volumes,
    meta: Mutex<BTreeMap<String, Vec<u8>>>,
    snapshots_taken: Mutex<u64>,
}

impl MemCatalog {
    pub fn new(block_size: u32) -> Self {
        MemCatalog {
            block_size,
            volumes: Arc::new(Mutex::new(HashMap::new())),
            meta: Mutex::new(BTreeMap::new()),
            snapshots_taken: Mutex::new(0),
        }
    }

    /// A copy of `source`'s blocks and size.
    fn copy_of(&self, source: &str) -> Result<(u64, BTreeMap<u64, MemBlock>)> {
        let vols = lock(&self.volumes);
        let s = vols
            .get(source)
            .ok_or_else(|| VolumeError::NotFound(source.to_string()))?;
        let s = lock(s);
        Ok((s.size, s.blocks.clone()))
    }

    /// A handle to a volume, as the concrete type.
    pub fn open_mem(&self, name: &str) -> Result<MemVolume> {
        let vols = lock(&self.volumes);
        let state = vols
            .get(name)
            .ok_or_else(|| VolumeError::NotFound(name.to_string()))?;
        Ok(MemVolume {
            name: name.to_string(),
            block_size: self.block_size,
            state: state.clone(),
            all: self.volumes.clone(),
        })
    }
}

impl Catalog for MemCatalog {
    fn list(&self) -> Result<Vec<VolumeInfo>> {
        let vols = lock(&self.volumes);
        let mut out: Vec<VolumeInfo> = vols
            .iter()
            .filter(|(name, _)| split_snapshot_name(name).is_none())
            .map(|(name, s)| {
                let s = lock(s);
                VolumeInfo {
                    name: name.clone(),
                    size_bytes: s.size,
                    written_bytes: s.written_bytes(self.block_size),
                }
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    fn open(&self, name: &str) -> Result<Arc<dyn Volume>> {
        Ok(Arc::new(self.open_mem(name)?))
    }

    fn create(&self, name: &str, size_bytes: u64) -> Result<()> {
        if !size_bytes.is_multiple_of(u64::from(self.block_size)) {
            return Err(VolumeError::Invalid(format!(
                "size {size_bytes} is not a multiple of the block size {}",
                self.block_size
            )));
        }
        if split_snapshot_name(name).is_some() {
            return Err(VolumeError::Invalid(format!(
                "invalid volume name {name:?}: '@' separates a volume from its snapshot"
            )));
        }
        let mut vols = lock(&self.volumes);
        if vols.contains_key(name) {
            return Err(VolumeError::AlreadyExists(name.to_string()));
        }
        let state = MemVolumeState {
            size: size_bytes,
            ..Default::default()
        };
        vols.insert(name.to_string(), Arc::new(Mutex::new(state)));
        Ok(())
    }

    fn delete(&self, name: &str) -> Result<()> {
        let mut vols = lock(&self.volumes);
        let prefix = format!("{name}@");
        if split_snapshot_name(name).is_none() && vols.keys().any(|k| k.starts_with(&prefix)) {
            return Err(VolumeError::Invalid(format!(
                "volume {name:?} has snapshots; delete them first"
            )));
        }
        let state = vols
            .remove(name)
            .ok_or_else(|| VolumeError::NotFound(name.to_string()))?;
        lock(&state).deleted = true;
        Ok(())
    }

    fn resize(&self, name: &str, size_bytes: u64, force: bool) -> Result<()> {
        if !size_bytes.is_multiple_of(u64::from(self.block_size)) {
            return Err(VolumeError::Invalid(format!(
                "size {size_bytes} is not a multiple of the block size {}",
                self.block_size
            )));
        }
        let vols = lock(&self.volumes);
        let state = vols
            .get(name)
            .ok_or_else(|| VolumeError::NotFound(name.to_string()))?;
        let mut s = lock(state);
        if s.read_only {
            return Err(VolumeError::ReadOnly);
        }
        let first_cut = size_bytes / u64::from(self.block_size);
        let has_data_past_end = s.blocks.range(first_cut..).next().is_some();
        if has_data_past_end && !force {
            return Err(VolumeError::Invalid(format!(
                "volume {name:?} has data past {size_bytes} bytes; use --force to discard it"
            )));
        }
        s.blocks.split_off(&first_cut);
        s.size = size_bytes;
        Ok(())
    }

    fn usage(&self) -> Result<PoolUsage> {
        let logical = self.list()?.iter().map(|v| v.size_bytes).sum();
        Ok(PoolUsage {
            physical_bytes: 0,
            available_bytes: u64::MAX / 2,
            logical_bytes: logical,
            block_size: self.block_size,
        })
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }

    fn meta_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(lock(&self.meta).get(key).cloned())
    }

    fn meta_put(&self, key: &str, value: Option<&[u8]>) -> Result<()> {
        let mut m = lock(&self.meta);
        match value {
            Some(v) => m.insert(key.to_string(), v.to_vec()),
            None => m.remove(key),
        };
        Ok(())
    }

    fn snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        let vols = lock(&self.volumes);
        let mut out: Vec<(String, u64, SnapshotInfo)> = vols
            .iter()
            .filter_map(|(name, s)| {
                let (volume, snapshot) = split_snapshot_name(name)?;
                let s = lock(s);
                let info = SnapshotInfo {
                    volume: volume.to_string(),
                    snapshot: snapshot.to_string(),
                    created_unix: 0,
                    size_bytes: s.size,
                    written_bytes: s.written_bytes(self.block_size),
                };
                Some((volume.to_string(), s.order, info))
            })
            .collect();
        out.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        Ok(out.into_iter().map(|(_, _, i)| i).collect())
    }

    fn snapshot_create(&self, volume: &str, snapshot: &str) -> Result<()> {
        if split_snapshot_name(volume).is_some() || snapshot.is_empty() || snapshot.contains('@') {
            return Err(VolumeError::Invalid(format!(
                "invalid snapshot name {volume:?}@{snapshot:?}"
            )));
        }
        let (size, blocks) = self.copy_of(volume)?;
        let full = format!("{volume}@{snapshot}");
        let mut vols = lock(&self.volumes);
        if vols.contains_key(&full) {
            return Err(VolumeError::AlreadyExists(full));
        }
        let mut n = lock(&self.snapshots_taken);
        *n += 1;
        let state = MemVolumeState {
            size,
            blocks,
            deleted: false,
            read_only: true,
            order: *n,
        };
        vols.insert(full, Arc::new(Mutex::new(state)));
        Ok(())
    }

    fn snapshot_delete(&self, volume: &str, snapshot: &str) -> Result<()> {
        let full = format!("{volume}@{snapshot}");
        let state = lock(&self.volumes)
            .remove(&full)
            .ok_or(VolumeError::NotFound(full))?;
        lock(&state).deleted = true;
        Ok(())
    }

    fn clone_volume(&self, source: &str, new: &str) -> Result<()> {
        let (size, blocks) = self.copy_of(source)?;
        self.create(new, size)?;
        let vols = lock(&self.volumes);
        if let Some(s) = vols.get(new) {
            lock(s).blocks = blocks;
        }
        Ok(())
    }

    fn rollback(&self, volume: &str, snapshot: &str, _force: bool) -> Result<()> {
        let (size, blocks) = self.copy_of(&format!("{volume}@{snapshot}"))?;
        let vols = lock(&self.volumes);
        let s = vols
            .get(volume)
            .ok_or_else(|| VolumeError::NotFound(volume.to_string()))?;
        let mut s = lock(s);
        s.size = size;
        s.blocks = blocks;
        Ok(())
    }

    fn diff(&self, from: &str, to: &str, offset: u64, len: u64) -> Result<Vec<Change>> {
        let (a_size, a) = self.copy_of(from)?;
        let (b_size, b) = self.copy_of(to)?;
        check_range("diff", to, offset, len, a_size.max(b_size))?;
        let bs = u64::from(self.block_size);
        let mut out = Vec::new();
        let mut pos = offset;
        while pos < offset + len {
            let n = (bs - pos % bs).min(offset + len - pos);
            let changed = a.get(&(pos / bs)) != b.get(&(pos / bs));
            push_change(&mut out, pos, n, changed);
            pos += n;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_writes_and_extents() -> Result<()> {
        let cat = MemCatalog::new(4096);
        cat.create("a", 4 * 4096)?;
        let v = cat.open("a")?;
        v.write(4096 + 10, &[7u8; 5000], false)?;
        let mut buf = vec![0u8; 4 * 4096];
        v.read(0, &mut buf)?;
        assert!(buf[..4096 + 10].iter().all(|&b| b == 0));
        assert!(buf[4096 + 10..4096 + 5010].iter().all(|&b| b == 7));
        assert!(buf[4096 + 5010..].iter().all(|&b| b == 0));
        let ext = v.block_status(0, 4 * 4096)?;
        assert_eq!(
            ext,
            vec![
                Extent {
                    offset: 0,
                    len: 4096,
                    kind: ExtentKind::Unmapped
                },
                Extent {
                    offset: 4096,
                    len: 8192,
                    kind: ExtentKind::Data
                },
                Extent {
                    offset: 12288,
                    len: 4096,
                    kind: ExtentKind::Unmapped
                },
            ]
        );
        assert!(v.write(4 * 4096 - 1, &[1, 2], false).is_err());
        v.write_zeroes(4096, 8192, false, false)?;
        assert_eq!(v.block_status(4096, 8192)?[0].kind, ExtentKind::Zero);
        v.trim(0, 4 * 4096, false)?;
        assert_eq!(v.block_status(0, 4 * 4096)?.len(), 1);
        Ok(())
    }
}
