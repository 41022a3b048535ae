//! The pool's side of volume claims ([`crate::volume_claims`], docs/S3.md "Volume claims"):
//! claiming a name before a volume of it is made, dropping this host's claims once a root
//! holds the volume's deletion, and tidying them at a sync.
//!
//! Owns: the names deleted since the last checkpoint ([`Pool::deleted_names_now`]), whose
//! claims wait for a root that holds the deletion. In a pool of one host nothing here runs.

use crate::error::{Error, Result};
use crate::format::hosts::VolumeClaim;
use crate::io::VolumeClaims;
use crate::locks::lock;
use crate::volume_claims::{claim_name, Claimed, TidyReport};
use std::sync::Arc;

use super::Pool;

impl Pool {
    /// The claims, if this pool is shared with other hosts.
    fn claims_if_shared(&self) -> Result<Option<Arc<dyn VolumeClaims>>> {
        if !self.is_shared()? {
            return Ok(None);
        }
        self.writable(&self.lock_state())?;
        match self.dir.volume_claims() {
            Some(c) => Ok(Some(c)),
            None => Err(Error::Invalid(
                "this pool is shared with other hosts, but its volume claims cannot be reached from this open (the log says why)".into(),
            )),
        }
    }

    /// Claim volume name `name` for this host at `turn` (0: a new volume; a move's turn: the
    /// adopter), by the protocol of the module docs ([`claim_name`]). `Ok(None)` in a pool of
    /// one host.
    pub(crate) fn claim_volume_name(&self, name: &str, turn: u32) -> Result<Option<VolumeClaim>> {
        let Some(reg) = self.claims_if_shared()? else {
            return Ok(None);
        };
        match claim_name(&*reg, self.slot, name, turn)? {
            Claimed::Won(c) => Ok(Some(c)),
            Claimed::Held(w, detail) => Err(self.held_error(&w, detail)),
        }
    }

    /// Delete this host's claims of `name` (its volume is gone from this part, or was never
    /// made). Best effort: a claim left here is deleted by [`Pool::tidy_volume_claims`].
    pub(crate) fn drop_volume_claims(&self, name: &str) {
        let Some(reg) = self.dir.volume_claims() else {
            return;
        };
        let result = reg.list(Some(name)).and_then(|claims| {
            claims
                .iter()
                .filter(|c| c.slot == self.slot)
                .try_for_each(|c| reg.delete(c))
        });
        if let Err(e) = result {
            tracing::warn!(
                "deleting this host's claim of volume {name}: {e} (deleted at a later sync)"
            );
        }
    }

    /// The volumes deleted so far whose claims wait: taken before a checkpoint, whose root
    /// then holds every one of these deletions.
    pub(crate) fn deleted_names_now(&self) -> std::collections::BTreeSet<String> {
        lock(&self.deleted_names).clone()
    }

    /// After the checkpoint that followed [`Pool::deleted_names_now`]: drop this host's claims
    /// of those names (unless a volume of that name was made again meanwhile).
    pub(crate) fn drop_claims_of_deleted(&self, names: std::collections::BTreeSet<String>) {
        for name in names {
            lock(&self.deleted_names).remove(&name);
            self.drop_claims_unless_held(&name);
        }
    }

    /// After a volume `name` failed to be made: delete this host's claims of it, unless a
    /// volume of that name is here (made by a concurrent command, whose claim it is).
    pub(crate) fn drop_claims_unless_held(&self, name: &str) {
        if !self.lock_state().md.names.contains_key(name) {
            self.drop_volume_claims(name);
        }
    }

    /// The claim of `name` this host's part holds, if any (the turn a move hands on).
    pub(crate) fn own_claim_turn(&self, name: &str) -> Result<Option<u32>> {
        let Some(reg) = self.claims_if_shared()? else {
            return Ok(None);
        };
        highest_turn(&*reg, name, |slot| slot == self.slot)
    }

    /// At a sync: claim the volumes this host holds without a claim (made before the pool
    /// was shared), and delete the claims of this host's slot whose volume is not here, left
    /// by an earlier writer (a crash between the two steps of a create, delete or move), and
    /// those below a higher claim of this slot of the same name (a volume adopted back).
    pub(crate) fn tidy_volume_claims(&self) -> Result<TidyReport> {
        let mut report = TidyReport::default();
        let Some(reg) = self.claims_if_shared()? else {
            return Ok(report);
        };
        let io = |e| Error::io("tidying the volume claims of this host", e);
        let all = reg.list(None).map_err(io)?;
        let (held, released): (Vec<String>, Vec<String>) = {
            let st = self.lock_state();
            let held = st
                .md
                .names
                .keys()
                .filter(|n| !n.contains('@'))
                .cloned()
                .collect();
            let released = st
                .md
                .meta
                .keys()
                .filter_map(|k| k.strip_prefix(crate::format::hosts::RELEASED_PREFIX))
                .map(str::to_string)
                .collect();
            (held, released)
        };
        let mine = |c: &&VolumeClaim| c.slot == self.slot;
        for name in &held {
            if !all.iter().filter(mine).any(|c| &c.name == name) {
                let of_name: Vec<VolumeClaim> =
                    all.iter().filter(|c| &c.name == name).cloned().collect();
                if let Some(w) = VolumeClaim::winner(&of_name) {
                    tracing::warn!(
                        "volume {name} of this host is claimed by the host in slot {:02x} too; \
                         rename or delete one of them",
                        w.slot
                    );
                    continue;
                }
                if reg.conditional() {
                    match reg.take_turn(name, 0).map_err(io)? {
                        Some((slot, _)) if slot == self.slot => {}
                        holder => {
                            tracing::warn!(
                                "volume {name} of this host is claimed by {} too; rename or \
                                 delete one of them",
                                holder.map_or("an unreadable turn object".to_string(), |(s, _)| {
                                    format!("the host in slot {s:02x}")
                                })
                            );
                            continue;
                        }
                    }
                }
                reg.put(name, 0).map_err(io)?;
                report.claimed += 1;
            }
        }
        // Turn objects of this slot with no claim beside them and no volume here: left by an
        // earlier writer of this part that crashed between the turn object and its claim.
        let turns = if reg.conditional() {
            reg.turns(None).map_err(io)?
        } else {
            Vec::new() // the timed protocol makes no turn objects, and never reads them
        };
        for (name, turn) in turns {
            let claimed = all.iter().any(|c| c.name == name && c.turn == turn);
            if claimed || held.contains(&name) || released.contains(&name) {
                continue;
            }
            if let Some((slot, writer)) = reg.turn_holder(&name, turn).map_err(io)? {
                if slot == self.slot && writer != reg.writer() {
                    reg.delete_turn(&name, turn).map_err(io)?;
                    report.deleted += 1;
                }
            }
        }
        for c in all.iter().filter(mine) {
            let gone = !held.contains(&c.name) && !released.contains(&c.name);
            // A volume that came back here (moved away, then adopted again) is claimed at
            // its new turn: the claims of its earlier stay are obsolete.
            let superseded = all
                .iter()
                .filter(mine)
                .any(|d| d.name == c.name && d.turn > c.turn);
            if superseded || (gone && c.writer != reg.writer()) {
                reg.delete(c).map_err(io)?;
                report.deleted += 1;
            }
        }
        Ok(report)
    }

    /// The error for a name whose winning claim `w` is another host's.
    fn held_error(&self, w: &VolumeClaim, detail: &str) -> Error {
        Error::HeldByHost {
            volume: w.name.clone(),
            host: self.host_name_of(w.slot),
            detail: detail.to_string(),
        }
    }
}

/// The highest turn of the claims of `name` in `reg` whose slot `pick` keeps.
pub(crate) fn highest_turn(
    reg: &dyn VolumeClaims,
    name: &str,
    pick: impl Fn(u8) -> bool,
) -> Result<Option<u32>> {
    let claims = reg
        .list(Some(name))
        .map_err(|e| Error::io(format!("listing the claims of volume {name}"), e))?;
    Ok(claims.iter().filter(|c| pick(c.slot)).map(|c| c.turn).max())
}
