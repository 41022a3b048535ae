//! The durability of a pool whose store offers a choice (an object store: see
//! [`crate::io::Dir::durability`]): reading it and `condense durability set`.
//!
//! Invariants:
//! - The durability is stored in the superblock (both copies) and changed only here, under
//!   the sync lock, followed by a checkpoint; a store that does not answer leaves the pool
//!   as it was.

use super::Pool;
use crate::error::{Error, Result};
use crate::format::{Durability, Superblock};

impl Pool {
    /// The durability of a pool in an object store (`None`: a local pool, whose flush
    /// always syncs its own disk).
    pub fn durability(&self) -> Option<Durability> {
        self.dir.durability()
    }

    /// `condense durability set`: store `d` as the pool's durability (every host that
    /// connects uses it) and apply it to this open at once. Returns the previous one.
    ///
    /// Under the sync lock, so no flush runs meanwhile: the superblock is replaced, then a
    /// checkpoint uploads everything written so far and starts a new journal and segment,
    /// which log their syncs (or not) by the new durability. Local → remote is therefore
    /// complete when this returns: what came before is in the bucket's root, what comes after
    /// is in write-ahead objects.
    pub fn set_durability(&self, d: Durability) -> Result<Durability> {
        let stored = self.dir.durability().ok_or_else(|| {
            Error::Invalid(format!(
                "pool {} is not in an object store: a flush of a local pool always returns once \
                 its own disk has it (durability is a setting of pools in an object store)",
                self.dir.describe()
            ))
        })?;
        if self.read_only {
            return Err(Error::ReadOnly);
        }
        let guard = crate::locks::lock(&self.sync_lock);
        let was = self.dir.durability().unwrap_or(stored);
        if was == d {
            return Ok(was);
        }
        self.writable(&self.lock_state())?;
        // Before anything changes: a store that does not answer leaves the pool as it was.
        self.dir.check_reachable()?;
        self.store_durability(d)?;
        let applied = self.dir.set_durability(d);
        debug_assert!(applied, "a store that has a durability can change it");
        self.checkpoint_locked(&guard).inspect_err(|e| {
            tracing::warn!(
                "pool {} stores durability {} now, but the checkpoint that applies it failed \
                 ({e}): it applies fully at the next checkpoint or open",
                self.dir.describe(),
                d.as_str()
            )
        })?;
        tracing::info!(
            "pool {}: durability {} -> {}",
            self.dir.describe(),
            was.as_str(),
            d.as_str()
        );
        Ok(was)
    }

    /// Replace the superblock with one naming durability `d` (one PUT per copy, each atomic).
    ///
    /// Besides init, this is the one place the superblock is written; in an encrypted pool it
    /// is authenticated again with the data key, as at init.
    pub(super) fn store_durability(&self, d: Durability) -> Result<()> {
        let mut sb = Superblock {
            durability: Some(d),
            ..self.sb.clone()
        };
        if let Some(c) = &self.crypto {
            // An encrypted pool's superblock carries a MAC over every field (docs/FORMAT.md).
            sb.authenticate(c);
        }
        crate::copies::write_both(&*self.dir, crate::format::SUPERBLOCK_NAME, &sb.encode())
    }
}
