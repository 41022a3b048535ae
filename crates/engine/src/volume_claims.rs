//! Volume claims: one host per volume name in a pool several hosts share (docs/S3.md
//! "Volume claims").
//!
//! Each host writes only the volumes of its own part, under its own part's lease, so a volume
//! has one writer as long as its name is in one part. A **claim** (`volumes/HEXNAME/T-SS-W`,
//! [`VolumeClaim`]) ties a name to a host: a host makes a volume of a name (create, import,
//! clone, adopt) only after its claim won, by the protocol of the pool's lease claims:
//!
//! 1. list the name's claims; if the winner ([`VolumeClaim::winner`]) is another host's at
//!    this turn or a later one, the name is refused (held by that host);
//! 2. put this host's claim at `turn`, timing the PUT: one slower than half of [`SETTLE`] is
//!    withdrawn and tried again (3 times at most);
//! 3. wait [`SETTLE`] and list again;
//! 4. the winner of the listed claims and ours takes the name; a loser deletes its claim.
//!
//! Two hosts that race for a name both reach step 4 having seen both claims (the argument of
//! `remote::lease`: every PUT took under `SETTLE / 2`, each relists `SETTLE` after its own), so
//! both apply one rule and one wins. A move raises the turn: the source records the next turn
//! in its hand-over, and the destination's claim at that turn wins over the source's older one,
//! which the source deletes with its copy of the volume. An adoption's claim (turn > 0) skips
//! steps 3 and 4: the hand-over names one slot, so no other host claims that turn, and every
//! other claim of the name is of a lower one (a new volume's, turn 0, is refused at step 1 by
//! the source's claim, which stays until the adopter holds the volume).
//!
//! Invariants:
//! - a host holds the volumes of its part, each with a winning claim of its slot (claims are
//!   made before the volume, and put afterwards for volumes made before the pool was shared:
//!   [`Pool::tidy_volume_claims`]);
//! - a claim is deleted only by its slot's writer, once a root of its part holds the volume's
//!   deletion (the sync or close after it), or when the volume was never made; a claim left by
//!   a crash is deleted by the next writer of that slot;
//! - in a pool of one host (nobody joined) nothing here runs: the pool lease is enough.

use crate::error::{Error, Result};
use crate::format::hosts::VolumeClaim;
use crate::io::VolumeClaims;
use crate::locks::lock;
use crate::pool::Pool;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// After putting a claim, wait this long before listing the claims again.
const SETTLE: Duration = Duration::from_millis(1000);
/// Claims put before a race is given up as too slow a store.
const TRIES: usize = 3;

/// What [`Pool::tidy_volume_claims`] did.
#[derive(Clone, Copy, Debug, Default)]
pub struct TidyReport {
    /// Claims put for volumes this host held without one.
    pub claimed: u64,
    /// Claims of this host's slot deleted: their volume is not here.
    pub deleted: u64,
}

impl Pool {
    /// The claims, if this pool is shared with other hosts.
    fn claims_if_shared(&self) -> Result<Option<Arc<dyn VolumeClaims>>> {
        if !self.is_shared()? {
            return Ok(None);
        }
        self.writable(&lock(&self.state))?;
        match self.dir.volume_claims() {
            Some(c) => Ok(Some(c)),
            None => Err(Error::Invalid(
                "this pool is shared with other hosts, but its volume claims cannot be reached from this open (the log says why)".into(),
            )),
        }
    }

    /// Claim volume name `name` for this host at `turn` (0: a new volume; a move's turn: the
    /// adopter), by the protocol of the module docs. `Ok(None)` in a pool of one host.
    pub(crate) fn claim_volume_name(&self, name: &str, turn: u32) -> Result<Option<VolumeClaim>> {
        let Some(reg) = self.claims_if_shared()? else {
            return Ok(None);
        };
        let io = |e| Error::io(format!("claiming volume {name} in the pool's bucket"), e);
        for _ in 0..TRIES {
            let before = reg.list(Some(name)).map_err(io)?;
            if let Some(w) = VolumeClaim::winner(&before).filter(|w| w.turn >= turn) {
                if w.slot == self.slot {
                    return Ok(Some(w.clone())); // ours already (an earlier writer of this slot)
                }
                return Err(self.held_error(w, ""));
            }
            let started = Instant::now();
            let mine = reg.put(name, turn).map_err(io)?;
            if turn > 0 {
                // An adoption: the hand-over named this host's slot and this turn, so no other
                // host claims it, and every other claim of the name is of a lower turn.
                return Ok(Some(mine));
            }
            if started.elapsed() > SETTLE / 2 {
                tracing::warn!(
                    "claiming volume {name}: the PUT took {:?} (more than {:?}): withdrawn, trying again",
                    started.elapsed(),
                    SETTLE / 2
                );
                let _ = reg.delete(&mine);
                continue;
            }
            std::thread::sleep(SETTLE);
            let mut after = reg.list(Some(name)).map_err(io)?;
            if !after.contains(&mine) {
                after.push(mine.clone());
            }
            match VolumeClaim::winner(&after) {
                Some(w) if w.slot != self.slot => {
                    let w = w.clone();
                    let _ = reg.delete(&mine);
                    return Err(self.held_error(
                        &w,
                        " (both hosts claimed the name at once; the claim rule chose, as docs/S3.md \"Volume claims\" says)",
                    ));
                }
                _ => return Ok(Some(mine)),
            }
        }
        Err(Error::Busy(format!(
            "claiming volume {name}: the store took more than {:?} three times to store a claim, too slow to claim the name safely: try again",
            SETTLE / 2
        )))
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
        if !lock(&self.state).md.names.contains_key(name) {
            self.drop_volume_claims(name);
        }
    }

    /// The claim of `name` this host's part holds, if any (the turn a move hands on).
    pub(crate) fn own_claim_turn(&self, name: &str) -> Result<Option<u32>> {
        let Some(reg) = self.claims_if_shared()? else {
            return Ok(None);
        };
        let claims = reg
            .list(Some(name))
            .map_err(|e| Error::io(format!("listing the claims of volume {name}"), e))?;
        Ok(claims
            .iter()
            .filter(|c| c.slot == self.slot)
            .map(|c| c.turn)
            .max())
    }

    /// At a sync: claim the volumes this host holds without a claim (made before the pool
    /// was shared), and delete the claims of this host's slot whose volume is not here, left
    /// by an earlier writer (a crash between the two steps of a create, delete or move).
    pub(crate) fn tidy_volume_claims(&self) -> Result<TidyReport> {
        let mut report = TidyReport::default();
        let Some(reg) = self.claims_if_shared()? else {
            return Ok(report);
        };
        let io = |e| Error::io("tidying the volume claims of this host", e);
        let all = reg.list(None).map_err(io)?;
        let (held, released): (Vec<String>, Vec<String>) = {
            let st = lock(&self.state);
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
                reg.put(name, 0).map_err(io)?;
                report.claimed += 1;
            }
        }
        for c in all.iter().filter(mine) {
            let gone = !held.contains(&c.name) && !released.contains(&c.name);
            if gone && c.writer != reg.writer() {
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
