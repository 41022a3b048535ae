//! Snapshots, clones, rollback and changed-block queries: a room of the pool, reached from
//! outside as `crate::snapshot`.
//!
//! Owns: the volume-level operations on shared block maps. A snapshot `VOL@SNAP` is a
//! read-only volume whose block map shares every page with `VOL` at the instant it was
//! taken; a clone is a writable volume made the same way; rollback gives a volume its
//! snapshot's map again. Sharing and copy-on-write of pages live in
//! [`crate::page_cache`] ("Sharing"); a shared leaf holds one reference on each chunk it
//! names, so a snapshot costs no chunk-table work until a volume's write copies a leaf.
//!
//! Invariants:
//! - Snapshot, clone and rollback are made inside a checkpoint ([`Pool::checkpoint_with`]):
//!   the source's pages are written first, so only stored pages are shared, and the change
//!   is durable (the new root names it) when the call returns. No journal record describes
//!   them; a crash before the root is written leaves the pool as it was.
//! - A snapshot refuses every change ([`Error::SnapshotReadOnly`]); it is deleted as a volume
//!   is (a small map at once, a big one detached in a checkpoint and released in steps by
//!   `pool/release.rs`), which releases only the pages no other tree holds. A rollback's old
//!   map goes the same way.
//! - A volume with snapshots cannot be deleted; rollback refuses while a writable handle to
//!   the volume is open (an NBD client, a mount) unless forced.
//! - Two versions differ at a block when their block-map entries differ. Leaves stored at
//!   the same page with no change in memory are equal without being read.

use super::{check_new_volume_name, Pool};
use crate::block_map;
use crate::error::{Error, Result};
use crate::format::{CHUNK_ID_LIMIT, ENTRY_UNMAPPED, MAP_PAGE_ENTRIES};
use crate::locks::lock;
use crate::metadata::{Metadata, VolumeState};
use std::collections::HashMap;

const PER: u64 = MAP_PAGE_ENTRIES as u64;

/// One snapshot, as listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotEntry {
    pub volume: String,
    pub snapshot: String,
    pub created_unix: u64,
    pub size_bytes: u64,
    pub data_blocks: u64,
    pub zero_blocks: u64,
}

/// Names (the part after `@`) of volume `vol`'s snapshots, oldest first.
pub(crate) fn snapshot_names_of(md: &Metadata, vol: u32) -> Vec<String> {
    let mut snaps: Vec<(u64, u32, &str)> = md
        .volumes
        .iter()
        .filter(|(_, v)| v.snapshot_of == Some(vol))
        .map(|(&id, v)| (v.created, id, v.name.as_str()))
        .collect();
    snaps.sort_unstable();
    snaps
        .into_iter()
        .map(|(_, _, n)| n.split_once('@').map_or(n, |(_, s)| s).to_string())
        .collect()
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn id_of(md: &Metadata, name: &str) -> Result<u32> {
    md.names
        .get(name)
        .copied()
        .ok_or_else(|| Error::NotFound(name.to_string()))
}

/// A plain volume's id (not a snapshot).
fn volume_id(md: &Metadata, name: &str) -> Result<u32> {
    let id = id_of(md, name)?;
    if md.volumes.get(&id).is_some_and(|v| v.snapshot_of.is_some()) {
        return Err(Error::Invalid(format!(
            "{name:?} is a snapshot; name a volume here"
        )));
    }
    Ok(id)
}

/// A snapshot's id.
fn snapshot_id(md: &Metadata, full: &str) -> Result<u32> {
    let id = id_of(md, full)?;
    if md.volumes.get(&id).is_none_or(|v| v.snapshot_of.is_none()) {
        return Err(Error::Invalid(format!("{full:?} is not a snapshot")));
    }
    Ok(id)
}

impl Pool {
    /// Freeze `volume` as it is now: every write that returned before is in the snapshot
    /// `volume@snapshot`. Costs the pages changed since the last checkpoint, not the volume.
    pub fn create_snapshot(&self, volume: &str, snapshot: &str) -> Result<()> {
        check_new_volume_name(snapshot)?;
        let full = format!("{volume}@{snapshot}");
        super::check_volume_name(&full)?;
        let sync = lock(&self.sync_lock);
        self.checkpoint_with(
            &sync,
            &|md| {
                volume_id(md, volume)?;
                if md.names.contains_key(&full) {
                    return Err(Error::AlreadyExists(full.clone()));
                }
                Ok(())
            },
            Some(&mut |md| {
                let src = volume_id(md, volume)?;
                let id = self.add_tree_copy(md, src, &full, Some(src))?;
                md.names.insert(full.clone(), id);
                Ok(())
            }),
        )
    }

    /// A new writable volume `new` with the content of `source` (a volume or
    /// `VOLUME@SNAPSHOT`), sharing its pages: instant, no data copied.
    pub fn clone_volume(&self, source: &str, new: &str) -> Result<()> {
        check_new_volume_name(new)?;
        id_of(&self.lock_state().md, source)?;
        if self.lock_state().md.names.contains_key(new) {
            return Err(Error::AlreadyExists(new.to_string()));
        }
        let claimed = self.claim_volume_name(new, 0)?;
        let made = self.clone_claimed(source, new);
        if made.is_err() && claimed.is_some() {
            self.drop_claims_unless_held(new);
        }
        made
    }

    fn clone_claimed(&self, source: &str, new: &str) -> Result<()> {
        let sync = lock(&self.sync_lock);
        let mut made = None;
        self.checkpoint_with(
            &sync,
            &|md| {
                id_of(md, source)?;
                if md.names.contains_key(new) {
                    return Err(Error::AlreadyExists(new.to_string()));
                }
                Ok(())
            },
            Some(&mut |md| {
                let src = id_of(md, source)?;
                made = Some(self.add_tree_copy(md, src, new, None)?);
                Ok(())
            }),
        )?;
        // Visible only now that it is durable: a write to it can never reach a journal
        // whose checkpoint does not know the volume.
        if let Some(id) = made {
            self.lock_state().md.names.insert(new.to_string(), id);
        }
        Ok(())
    }

    /// A new volume entry `name` whose map shares `src`'s pages (inside a checkpoint).
    fn add_tree_copy(
        &self,
        md: &mut Metadata,
        src: u32,
        name: &str,
        snapshot_of: Option<u32>,
    ) -> Result<u32> {
        let s = md
            .volumes
            .get(&src)
            .ok_or_else(|| Error::NotFound(name.to_string()))?;
        let state = VolumeState {
            name: name.to_string(),
            size: s.size,
            counts: s.counts,
            snapshot_of,
            created: now_unix(),
        };
        let id = md.next_vol;
        md.pages.clone_tree(u64::from(src), u64::from(id))?;
        md.volumes.insert(id, state);
        md.next_vol = id + 1;
        md.tree_added(id);
        Ok(id)
    }

    /// Make `volume` read again as `volume@snapshot` (size included). Refused while a
    /// writable handle to the volume is open, unless `force` (then its users see the old
    /// content under their feet, as after a disk swap).
    pub fn rollback_volume(&self, volume: &str, snapshot: &str, force: bool) -> Result<()> {
        let full = format!("{volume}@{snapshot}");
        let vol_lock = self.volume_lock(self.volume_id(volume)?);
        let _w = lock(&vol_lock);
        let sync = lock(&self.sync_lock);
        self.checkpoint_with(
            &sync,
            &|md| {
                let vol = volume_id(md, volume)?;
                let snap = snapshot_id(md, &full)?;
                if md.volumes.get(&snap).and_then(|v| v.snapshot_of) != Some(vol) {
                    return Err(Error::Invalid(format!(
                        "{full:?} is not a snapshot of volume {volume:?}"
                    )));
                }
                let writers = lock(&self.writers).get(&vol).copied().unwrap_or(0);
                if writers > 0 && !force {
                    return Err(Error::Busy(format!(
                        "volume {volume:?} is open for writing ({writers} handle(s): an NBD client or a mount); \
                         disconnect it first, or roll back anyway with --force"
                    )));
                }
                Ok(())
            },
            Some(&mut |md| {
                let vol = volume_id(md, volume)?;
                let snap = snapshot_id(md, &full)?;
                // The old map goes in steps in the background (pool/release.rs).
                let tree = md.next_release_tree();
                md.detach_tree(vol, tree, format!("{volume} (before rollback)"))?;
                md.pages.clone_tree(u64::from(snap), u64::from(vol))?;
                md.tree_added(vol);
                let (size, counts) = md
                    .volumes
                    .get(&snap)
                    .map(|s| (s.size, s.counts))
                    .ok_or_else(|| Error::NotFound(full.clone()))?;
                if let Some(v) = md.volumes.get_mut(&vol) {
                    v.size = size;
                    v.counts = counts;
                }
                Ok(())
            }),
        )?;
        self.wake_releaser();
        Ok(())
    }

    /// Delete `volume@snapshot`: pages and chunks only it holds are released (the space
    /// returns at the next GC).
    pub fn delete_snapshot(&self, volume: &str, snapshot: &str) -> Result<()> {
        let full = format!("{volume}@{snapshot}");
        snapshot_id(&self.lock_state().md, &full)?;
        self.delete_volume(&full)
    }

    /// Every snapshot, by volume and then oldest first.
    pub fn snapshot_list(&self) -> Vec<SnapshotEntry> {
        let st = self.lock_state();
        let md = &st.md;
        let mut out: Vec<(String, u64, u32, SnapshotEntry)> = md
            .volumes
            .iter()
            .filter_map(|(&id, v)| {
                let of = md.volumes.get(&v.snapshot_of?)?;
                let snapshot = v.name.split_once('@').map_or("", |(_, s)| s).to_string();
                let e = SnapshotEntry {
                    volume: of.name.clone(),
                    snapshot,
                    created_unix: v.created,
                    size_bytes: v.size,
                    data_blocks: v.counts.data_blocks,
                    zero_blocks: v.counts.zero_blocks,
                };
                Some((of.name.clone(), v.created, id, e))
            })
            .collect();
        out.sort_by(|a, b| (&a.0, a.1, a.2).cmp(&(&b.0, b.1, b.2)));
        out.into_iter().map(|(_, _, _, e)| e).collect()
    }

    /// Bytes deleting `volume@snapshot` would free (once GC runs): the stored chunks whose
    /// every reference comes from leaves only this snapshot holds, plus those metadata pages.
    pub fn snapshot_freeable_bytes(&self, volume: &str, snapshot: &str) -> Result<u64> {
        let full = format!("{volume}@{snapshot}");
        let mut st = self.lock_state();
        let md = &mut st.md;
        let snap = snapshot_id(md, &full)?;
        let mut held: HashMap<u64, u32> = HashMap::new();
        let units = md.pages.exclusive_leaves(u64::from(snap), &mut |leaf| {
            block_map::leaf_chunks(leaf, |id| *held.entry(id).or_default() += 1);
            Ok(())
        })?;
        // Entries naming a forward count for the chunk it forwards to.
        let mut chunks: HashMap<u64, (u32, u64, u32)> = HashMap::new();
        for (id, n) in held {
            if let Some((rid, e)) = md.chunks.resolve(&mut md.pages, id)? {
                let c = chunks
                    .entry(rid)
                    .or_insert((e.refs, e.loc.record_bytes(), 0));
                c.2 += n;
            }
        }
        let mut bytes = units * crate::page_cache::UNIT as u64;
        for (refs, record, n) in chunks.into_values() {
            if refs <= n {
                bytes += record;
            }
        }
        Ok(bytes)
    }

    /// Which bytes of `[offset, offset + len)` differ between `from` and `to` (volumes or
    /// snapshots), block by block: runs in order covering the range, clipped to it. Past a
    /// version's end its blocks are unmapped. Costs the leaves the two maps hold in the range,
    /// not its length (see [`Pool::diff_step`]).
    pub fn diff_bytes(
        &self,
        from: &str,
        to: &str,
        offset: u64,
        len: u64,
    ) -> Result<Vec<condense_api::Change>> {
        let end = offset
            .checked_add(len)
            .ok_or_else(|| Error::Invalid("range past 2^64 bytes".into()))?;
        let mut out = Vec::new();
        let mut at = offset;
        while at < end {
            let (part, next) = self.diff_step(from, to, at, end - at)?;
            for c in part {
                condense_api::push_change(&mut out, c.offset, c.len, c.changed);
            }
            at = next;
        }
        Ok(out)
    }

    /// One bounded step of [`Pool::diff_bytes`]: the runs of a prefix `[offset, next)` of the
    /// range, and `next` (`offset + len` when the step reached the end). A step looks at no
    /// more than [`DIFF_STEP_LEAVES`] existing leaves of each map and skips every subtree
    /// neither map holds without reading it, so a sparse 1 EiB volume costs what it holds.
    /// The state lock is held for one step only; callers that may be asked to stop (a
    /// control-socket client that went away) check between steps.
    pub fn diff_step(
        &self,
        from: &str,
        to: &str,
        offset: u64,
        len: u64,
    ) -> Result<(Vec<condense_api::Change>, u64)> {
        let bs = u64::from(self.block_size());
        let end_byte = offset
            .checked_add(len)
            .ok_or_else(|| Error::Invalid("range past 2^64 bytes".into()))?;
        let mut out: Vec<condense_api::Change> = Vec::new();
        if len == 0 {
            return Ok((out, end_byte));
        }
        let first = offset / bs;
        let end = end_byte.div_ceil(bs);
        let first_leaf = first / PER;
        let end_leaf = end.div_ceil(PER);
        let mut st = self.lock_state();
        let md = &mut st.md;
        let a = u64::from(id_of(md, from)?);
        let b = u64::from(id_of(md, to)?);
        let pa = md
            .pages
            .leaf_pages_first(a, first_leaf, end_leaf, DIFF_STEP_LEAVES)?;
        let pb = md
            .pages
            .leaf_pages_first(b, first_leaf, end_leaf, DIFF_STEP_LEAVES)?;
        // Past the last leaf of a map that stopped early, that map is not known yet.
        let mut stop_leaf = end_leaf;
        for p in [&pa, &pb] {
            if p.len() >= DIFF_STEP_LEAVES {
                if let Some(last) = p.last() {
                    stop_leaf = stop_leaf.min(last.index + 1);
                }
            }
        }
        // Blocks [lo, hi), clipped to the byte range.
        let mut push = |lo: u64, hi: u64, changed: bool| {
            let (x, y) = (
                lo.saturating_mul(bs).max(offset),
                hi.saturating_mul(bs).min(end_byte),
            );
            condense_api::push_change(&mut out, x, y.saturating_sub(x), changed);
        };
        let (mut i, mut j) = (0, 0);
        // Leaves before `l` are answered.
        let mut l = first_leaf;
        loop {
            let la = pa.get(i).filter(|p| p.index < stop_leaf).copied();
            let lb = pb.get(j).filter(|p| p.index < stop_leaf).copied();
            // The next leaf either map holds; everything before it is a hole in both.
            let next = match (la, lb) {
                (None, None) => stop_leaf,
                (Some(x), None) => x.index,
                (None, Some(y)) => y.index,
                (Some(x), Some(y)) => x.index.min(y.index),
            };
            if next > l {
                push((l * PER).max(first), (next * PER).min(end), false);
            }
            if next >= stop_leaf {
                break;
            }
            let la = la.filter(|p| p.index == next);
            let lb = lb.filter(|p| p.index == next);
            i += usize::from(la.is_some());
            j += usize::from(lb.is_some());
            let lo = (next * PER).max(first);
            let hi = ((next + 1) * PER).min(end);
            let same = match (la, lb) {
                (Some(x), Some(y)) => x.page != 0 && x.page == y.page && !x.dirty && !y.dirty,
                _ => false,
            };
            if same {
                push(lo, hi, false);
            } else {
                let ea = leaf_entries(md, a, next, la.is_some())?;
                let eb = leaf_entries(md, b, next, lb.is_some())?;
                for blk in lo..hi {
                    let k = (blk - next * PER) as usize;
                    push(blk, blk + 1, changed(md, ea[k], eb[k])?);
                }
            }
            l = next + 1;
        }
        let covered = if stop_leaf >= end_leaf {
            end_byte
        } else {
            stop_leaf
                .saturating_mul(PER)
                .saturating_mul(bs)
                .min(end_byte)
        };
        Ok((out, covered))
    }
}

/// Existing leaves of each map one [`Pool::diff_step`] looks at (and the most it reads:
/// twice this many 4 KiB pages under the state lock).
pub const DIFF_STEP_LEAVES: usize = 256;

impl Pool {
    /// The size of a volume or snapshot by name.
    pub fn volume_size_any(&self, name: &str) -> Result<u64> {
        let st = self.lock_state();
        let id = id_of(&st.md, name)?;
        st.md
            .volumes
            .get(&id)
            .map(|v| v.size)
            .ok_or_else(|| Error::NotFound(name.to_string()))
    }
}

/// The 512 entries of leaf `l` of `tree` (all unmapped if it does not exist).
fn leaf_entries(md: &mut Metadata, tree: u64, l: u64, present: bool) -> Result<Vec<u64>> {
    let mut e = vec![ENTRY_UNMAPPED; MAP_PAGE_ENTRIES];
    if present {
        md.pages.for_each_leaf(tree, l, l + 1, &mut |_, data| {
            block_map::leaf_entries_all(data, &mut e);
            Ok(false)
        })?;
    }
    Ok(e)
}

/// Whether map entries `x` and `y` differ in data: two chunks of one fingerprint (a
/// duplicate the sparse index stored again, or a forward and the chunk it names) do not, so a
/// block written again with the same data is not changed.
fn changed(md: &mut Metadata, x: u64, y: u64) -> Result<bool> {
    if x == y {
        return Ok(false);
    }
    if x >= CHUNK_ID_LIMIT || y >= CHUNK_ID_LIMIT {
        return Ok(true);
    }
    let fp =
        |md: &mut Metadata, id| Ok::<_, Error>(md.chunks.get(&mut md.pages, id)?.map(|e| e.fp));
    Ok(!matches!((fp(md, x)?, fp(md, y)?), (Some(a), Some(b)) if a == b))
}
