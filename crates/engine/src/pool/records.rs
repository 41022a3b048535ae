//! The pool's named metadata records and volume table, read and changed as a whole: what
//! the protocols kept in records (the hosts' fold, hand-overs and forgets, [`crate::hosts`])
//! ask of the core.
//!
//! Owns: [`Records`], a read-only view under the state lock. A read sees one consistent
//! state; [`Pool::update_records`] checks and commits in the same hold, so nothing changes
//! between what it read and what it journals.

use crate::error::Result;
use crate::format::hosts::Meta;
use crate::format::JournalRecord;
use crate::metadata::Metadata;

use super::Pool;

/// The named records and volume names of one pool, as they are while the view lives.
pub(crate) struct Records<'a> {
    md: &'a Metadata,
}

impl<'a> Records<'a> {
    /// The named metadata records (`hosts/...`, `scrub/last`, ...).
    pub(crate) fn meta(&self) -> &'a Meta {
        &self.md.meta
    }

    /// Whether a volume or snapshot of that name exists.
    pub(crate) fn has_volume(&self, name: &str) -> bool {
        self.md.names.contains_key(name)
    }

    /// Every volume and snapshot name (snapshots as `VOL@SNAP`), in no order.
    pub(crate) fn names(&self) -> impl Iterator<Item = &'a String> + 'a {
        self.md.names.keys()
    }

    /// Whether volume `vol` is a snapshot (`None`: no such volume).
    pub(crate) fn is_snapshot(&self, vol: u32) -> Option<bool> {
        self.md.volumes.get(&vol).map(|v| v.snapshot_of.is_some())
    }

    /// The names (after `@`) of volume `vol`'s snapshots, oldest first.
    pub(crate) fn snapshots_of(&self, vol: u32) -> Vec<String> {
        super::snapshots::snapshot_names_of(self.md, vol)
    }
}

impl Pool {
    /// `f` over this pool's records and volume names, under the state lock.
    pub(crate) fn read_records<R>(&self, f: impl FnOnce(&Records<'_>) -> R) -> R {
        let st = self.lock_state();
        f(&Records { md: &st.md })
    }

    /// Refuse if this pool cannot be changed now (read-only, or poisoned by a failed write).
    pub(crate) fn check_writable(&self) -> Result<()> {
        self.writable(&self.lock_state())
    }

    /// Apply and journal `records` (the core's one way to change state, [`Pool::commit`]).
    pub(crate) fn commit_records(&self, records: Vec<JournalRecord>) -> Result<()> {
        let mut st = self.lock_state();
        self.commit(&mut st, records)?;
        Ok(())
    }

    /// In one hold of the state lock: refuse if the pool cannot be changed, run `f` over the
    /// records, and apply and journal the records it returns; its value is returned.
    pub(crate) fn update_records<R>(
        &self,
        f: impl FnOnce(&Records<'_>) -> Result<(Vec<JournalRecord>, R)>,
    ) -> Result<R> {
        let mut st = self.lock_state();
        self.writable(&st)?;
        let (records, r) = f(&Records { md: &st.md })?;
        if !records.is_empty() {
            self.commit(&mut st, records)?;
        }
        Ok(r)
    }
}
