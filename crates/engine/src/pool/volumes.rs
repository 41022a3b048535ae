//! The pool's volume table: creating, deleting, resizing and listing volumes, and handles
//! on them ([`super::handle::VolumeHandle`]).

use crate::error::{Error, Result};
use crate::format::*;
use crate::locks::lock;

use super::{check_new_volume_name, Pool};
use crate::volume_counters::{VolumeIo, VolumeIoValues};
use std::collections::HashMap;
use std::sync::Arc;

/// The most block-map leaves a deletion releases in its own commit (a few milliseconds);
/// a bigger map is released in the background.
const RELEASE_AT_ONCE_LEAVES: usize = 16;

/// The id of volume or snapshot `name` if it may be deleted: a volume with snapshots may not.
fn deletable(md: &crate::metadata::Metadata, name: &str) -> Result<u32> {
    let vol = *md
        .names
        .get(name)
        .ok_or_else(|| Error::NotFound(name.to_string()))?;
    let snaps = super::snapshots::snapshot_names_of(md, vol);
    if let Some(first) = snaps.first() {
        return Err(Error::Invalid(format!(
            "volume {name:?} has {} snapshot(s) ({}); delete them first (`condense snapshot delete {name}@{first}`)",
            snaps.len(),
            snaps.join(", "),
        )));
    }
    Ok(vol)
}

/// The records that do not outlive volume `name`: its "import in progress" mark
/// (engine::importing), a half-made hand-over or a name conflict (engine::hosts).
fn marks_of(name: &str) -> [String; 3] {
    [
        super::importing::key(name),
        crate::format::hosts::Pending::key(name),
        format!("{}{name}", crate::format::hosts::CONFLICT_PREFIX),
    ]
}

/// Block-map leaves that exist a step of a shrink cuts off at most. One (512 entries): a VM
/// request that meets a step waits for it, and 4 per step doubled the VMs' p99 during a
/// shrink for half its wall time (bench/README.md "admin-stall.sh", 2026-11-29).
const SHRINK_STEP_LEAVES: usize = 1;

impl Pool {
    fn check_size(&self, size: u64) -> Result<()> {
        let bs = u64::from(self.sb.block_size);
        if size == 0 || !size.is_multiple_of(bs) {
            return Err(Error::Invalid(format!(
                "size {size} is not a positive multiple of the pool's block size ({bs} bytes)"
            )));
        }
        if size > 1 << 60 {
            return Err(Error::Invalid(format!("size {size} is larger than 1 EiB")));
        }
        Ok(())
    }

    pub fn create_volume(&self, name: &str, size: u64) -> Result<()> {
        self.create_volume_at(name, size, 0)
    }

    /// [`Pool::create_volume`]; in a pool shared with other hosts, once this host's claim of
    /// the name at `turn` won (crate::volume_claims).
    pub(crate) fn create_volume_at(&self, name: &str, size: u64, turn: u32) -> Result<()> {
        self.create_volume_with(name, size, turn, Vec::new())
    }

    /// [`Pool::create_volume_at`], with `extra` records committed with the creation (a
    /// hand-over's `hosts/pending/NAME`: the volume and the record are durable together).
    pub(crate) fn create_volume_with(
        &self,
        name: &str,
        size: u64,
        turn: u32,
        extra: Vec<JournalRecord>,
    ) -> Result<()> {
        check_new_volume_name(name)?;
        self.check_size(size)?;
        if let Some(host) = self.held_by_another_host(name) {
            return Err(Error::HeldByHost {
                volume: name.into(),
                host,
                detail: " (its newest root holds it)".into(),
            });
        }
        if self.lock_state().md.names.contains_key(name) {
            return Err(Error::AlreadyExists(name.to_string()));
        }
        let claimed = self.claim_volume_name(name, turn)?;
        self.handover_point(super::peers::STEP_CLAIMED)?;
        let made = self.create_claimed(name, size, extra);
        if made.is_err() && claimed.is_some() {
            self.drop_claims_unless_held(name);
        }
        made
    }

    fn create_claimed(&self, name: &str, size: u64, extra: Vec<JournalRecord>) -> Result<()> {
        let mut st = self.lock_state();
        self.writable(&st)?;
        if st.md.names.contains_key(name) {
            return Err(Error::AlreadyExists(name.to_string()));
        }
        let vol = st.md.next_vol;
        let mut records = vec![JournalRecord::VolumeCreate {
            vol,
            size,
            name: name.to_string(),
        }];
        records.extend(extra);
        self.commit(&mut st, records)?;
        drop(st);
        self.after_metadata_change()
    }

    /// Delete a volume or snapshot (refused while a volume has snapshots). A map of at most
    /// [`RELEASE_AT_ONCE_LEAVES`] leaves is released in the deletion's own commit
    /// (`VolumeDelete`). A bigger one is detached inside a checkpoint, so the root that holds
    /// the deletion is the one that names the detached map (version 3: builds that cannot
    /// release it refuse the pool, docs/FORMAT.md "Background release"), and released in
    /// steps in the background (pool/release.rs).
    pub fn delete_volume(&self, name: &str) -> Result<()> {
        let vol_lock = self.volume_lock(self.volume_id(name)?);
        let _w = lock(&vol_lock);
        let mut st = self.lock_state();
        self.writable(&st)?;
        let vol = deletable(&st.md, name)?;
        let leaves = st.md.pages.leaf_pages_first(
            u64::from(vol),
            0,
            u64::MAX,
            RELEASE_AT_ONCE_LEAVES + 1,
        )?;
        if leaves.len() > RELEASE_AT_ONCE_LEAVES {
            drop(st);
            let sync = lock(&self.sync_lock);
            self.checkpoint_with(
                &sync,
                &|md| deletable(md, name).map(drop),
                Some(&mut |md| {
                    let vol = deletable(md, name)?;
                    let tree = md.next_release_tree();
                    md.detach_tree(vol, tree, name.to_string())?;
                    md.volumes.remove(&vol);
                    md.names.remove(name);
                    for mark in marks_of(name) {
                        md.meta.remove(&mark);
                    }
                    Ok(())
                }),
            )?;
        } else {
            let mut records = vec![JournalRecord::VolumeDelete { vol }];
            for mark in marks_of(name) {
                if st.md.meta.contains_key(&mark) {
                    records.push(JournalRecord::MetaPut {
                        key: mark,
                        value: None,
                    });
                }
            }
            self.commit(&mut st, records)?;
            drop(st);
        }
        if !name.contains('@') {
            // Its claim goes once a root holds the deletion (the next sync or close).
            lock(&self.deleted_names).insert(name.to_string());
        }
        self.wake_releaser();
        self.after_metadata_change()
    }

    /// Grow or shrink a volume. Shrinking below written blocks needs `force`.
    pub fn resize_volume(&self, name: &str, size: u64, force: bool) -> Result<()> {
        self.check_size(size)?;
        let vol_lock = self.volume_lock(self.volume_id(name)?);
        let _w = lock(&vol_lock);
        let mut st = self.lock_state();
        self.writable(&st)?;
        let vol = *st
            .md
            .names
            .get(name)
            .ok_or_else(|| Error::NotFound(name.to_string()))?;
        st.md.writable_volume_for(vol, name, "resize", 0, 0)?;
        let first_cut = size / u64::from(self.sb.block_size);
        let first_data =
            crate::block_map::first_mapped(&mut st.md.pages, u64::from(vol), first_cut)?;
        if let Some(block) = first_data {
            if !force {
                return Err(Error::Invalid(format!(
                    "volume {name:?} has data at block {block} (offset {}), past the new size {size}; \
                     shrinking would discard it (use --force to discard)",
                    block * u64::from(self.sb.block_size)
                )));
            }
        }
        if first_data.is_some() {
            // Cut what lies past the new end off in bounded steps, the state lock let go
            // between them, so other volumes' I/O goes on (a whole-block write past the new
            // end meanwhile is unmapped by the last resize).
            drop(st);
            self.shrink_in_steps(vol, name, size)?;
            st = self.lock_state();
            self.writable(&st)?;
            st.md.writable_volume_for(vol, name, "resize", 0, 0)?;
        }
        self.commit(&mut st, vec![JournalRecord::VolumeResize { vol, size }])?;
        drop(st);
        self.after_metadata_change()
    }

    /// Shrink `vol` towards `size` from its end, each resize cutting off at most
    /// [`SHRINK_STEP_LEAVES`] block-map leaves that exist (its walk unmaps only those), with
    /// the state lock let go between steps (and a pause at least as long as the step, so
    /// waiting I/O gets it: `Pacer`). A crash part way leaves the volume between its old and
    /// new sizes; blocks past the size it has are gone.
    fn shrink_in_steps(&self, vol: u32, name: &str, size: u64) -> Result<()> {
        let bs = u64::from(self.sb.block_size);
        let per = MAP_PAGE_ENTRIES as u64;
        let first_leaf = size / bs / per;
        let leaves =
            self.lock_state()
                .md
                .pages
                .present_leaves(u64::from(vol), first_leaf, u64::MAX)?;
        let mut pace = super::Pacer::default();
        for step in leaves.rchunks(SHRINK_STEP_LEAVES) {
            pace.step();
            let cut = (step[0] * per * bs).max(size);
            let mut st = self.lock_state();
            self.writable(&st)?;
            let now = st.md.writable_volume_for(vol, name, "resize", 0, 0)?.size;
            if cut < now {
                self.commit(
                    &mut st,
                    vec![JournalRecord::VolumeResize { vol, size: cut }],
                )?;
            }
        }
        Ok(())
    }

    /// Names and sizes of all volumes (not snapshots), sorted by name.
    pub fn volumes(&self) -> Vec<(String, u64)> {
        self.volume_infos()
            .into_iter()
            .map(|v| (v.name, v.size_bytes))
            .collect()
    }

    /// Names, sizes and written bytes of all volumes (not snapshots), sorted by name: from
    /// the metadata in memory, without the statistics' directory walk, bucket listing or
    /// per-volume figures (NBD's export list and FUSE's directory read it often).
    pub fn volume_infos(&self) -> Vec<condense_api::VolumeInfo> {
        let bs = u64::from(self.block_size());
        let st = self.lock_state();
        let mut v: Vec<_> = st
            .md
            .volumes
            .values()
            .filter(|v| v.snapshot_of.is_none())
            .map(|v| condense_api::VolumeInfo {
                name: v.name.clone(),
                size_bytes: v.size,
                written_bytes: v.counts.data_blocks * bs,
            })
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    pub fn volume_id(&self, name: &str) -> Result<u32> {
        self.lock_state()
            .md
            .names
            .get(name)
            .copied()
            .ok_or_else(|| Error::NotFound(name.to_string()))
    }

    /// A handle to a volume.
    pub fn volume(&self, name: &str) -> Result<super::handle::VolumeHandle> {
        let (vol, snapshot) = {
            let st = self.lock_state();
            let vol = *st
                .md
                .names
                .get(name)
                .ok_or_else(|| Error::NotFound(name.to_string()))?;
            let snapshot = st
                .md
                .volumes
                .get(&vol)
                .is_some_and(|v| v.snapshot_of.is_some());
            (vol, snapshot)
        };
        let pool = self
            .me
            .upgrade()
            .ok_or_else(|| Error::Invalid("pool is closing".into()))?;
        let read_only = self.read_only || snapshot;
        if !read_only {
            *lock(&self.writers).entry(vol).or_default() += 1;
        }
        Ok(super::handle::VolumeHandle::new(
            pool,
            vol,
            name.to_string(),
            read_only,
        ))
    }

    pub(crate) fn volume_size(&self, vol: u32, name: &str) -> Result<u64> {
        let st = self.lock_state();
        st.md
            .volumes
            .get(&vol)
            .map(|v| v.size)
            .ok_or_else(|| Error::NotFound(name.to_string()))
    }
}

impl Pool {
    /// The counters of `name`, shared by every handle of it (created on first use).
    pub(crate) fn volume_io_for(&self, name: &str) -> Arc<VolumeIo> {
        lock(&self.volume_io)
            .entry(name.to_string())
            .or_default()
            .clone()
    }

    /// Every volume's I/O counters, by name: each volume (with zeros if nothing touched it
    /// since the pool opened) and each snapshot opened since. Internal volumes (names
    /// starting with '.', such as FUSE file contents) are included. Counters of names that
    /// no longer exist and that no handle holds are dropped here.
    pub fn volume_io(&self) -> Vec<(String, VolumeIoValues)> {
        // Every name of the pool, and whether it is a snapshot's.
        let names: HashMap<String, bool> = self
            .lock_state()
            .md
            .volumes
            .values()
            .map(|v| (v.name.clone(), v.snapshot_of.is_some()))
            .collect();
        let mut map = lock(&self.volume_io);
        map.retain(|name, io| Arc::strong_count(io) > 1 || names.contains_key(name));
        let mut out: Vec<(String, VolumeIoValues)> = map
            .iter()
            .map(|(name, io)| (name.clone(), io.values()))
            .collect();
        for (name, snapshot) in names {
            if !snapshot && !map.contains_key(&name) {
                out.push((name, VolumeIoValues::default()));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}
