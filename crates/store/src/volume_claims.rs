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
//! 2. on a store with conditional PUT ([`VolumeClaims::conditional`]): create the turn object
//!    of (name, turn) if absent ([`VolumeClaims::take_turn`]); its creator wins the turn, puts
//!    its claim and takes the name (steps 3-5 do not apply);
//! 3. otherwise put this host's claim at `turn`. The window from just before step 1's LIST to
//!    the end of the PUT ([`Window`], `CLOCK_BOOTTIME`) must be within [`WINDOW_BOUND`], or the
//!    claim is withdrawn and the protocol starts again (3 times at most);
//! 4. wait [`SETTLE`] and list again;
//! 5. the winner of the listed claims and ours takes the name; a loser deletes its claim.
//!
//! Two hosts that race for a name both reach step 5 having seen both claims (the argument of
//! docs/S3.md "Lease: claims", with its assumptions: each window under `SETTLE / 2`, each
//! relist `SETTLE` after its own PUT), so both apply one rule and one wins. A PUT that failed is
//! withdrawn (it may land later). A move raises the turn: the source records the next turn
//! in its hand-over, and the destination's claim at that turn wins over the source's older one,
//! which the source deletes with its copy of the volume. An adoption's claim (turn > 0) skips
//! steps 4 and 5: the hand-over names one slot, so no other host claims that turn, and every
//! other claim of the name is of a lower one (a new volume's, turn 0, is refused at step 1 by
//! the source's claim, which stays until the adopter holds the volume).
//!
//! Invariants:
//! - a host holds the volumes of its part, each with a winning claim of its slot (claims are
//!   made before the volume, and put afterwards for volumes made before the pool was shared:
//!   `Pool::tidy_volume_claims`);
//! - a claim is deleted only by its slot's writer, once a root of its part holds the volume's
//!   deletion (the sync or close after it), or when the volume was never made; a claim left by
//!   a crash is deleted by the next writer of that slot;
//! - in a pool of one host (nobody joined) nothing here runs: the pool lease is enough.

use crate::claim_window::{Window, SETTLE, WINDOW_BOUND};
use crate::io::VolumeClaims;
use crate::{Error, Result};
use condense_format::hosts::VolumeClaim;
/// Claims put before a race is given up as too slow a store.
const TRIES: usize = 3;

/// What `Pool::tidy_volume_claims` did.
#[derive(Clone, Copy, Debug, Default)]
pub struct TidyReport {
    /// Claims put for volumes this host held without one.
    pub claimed: u64,
    /// Claims of this host's slot deleted: their volume is not here.
    pub deleted: u64,
}

/// What [`claim_name`] decided.
#[derive(Debug, PartialEq, Eq)]
pub enum Claimed {
    /// This host's claim of the name (new, or one of its slot already there).
    Won(VolumeClaim),
    /// Another host's claim wins (a claim of its, or the turn object it created), and why.
    Held(VolumeClaim, &'static str),
}

const RACED_TIMED: &str = " (both hosts claimed the name at once; the claim rule chose, as docs/S3.md \"Volume claims\" says)";
const RACED_CONDITIONAL: &str = " (both hosts claimed the name at once; the store's conditional PUT chose, as docs/S3.md \"Volume claims\" says)";

/// Claim `name` at `turn` for the writer of slot `slot` through `reg` (the module docs): on a
/// store with conditional PUT by creating the turn object, elsewhere by the timed protocol
/// whose window (first LIST to the end of the PUT, [`Window`]) must stay within
/// [`WINDOW_BOUND`] or the claim is withdrawn and made again.
pub fn claim_name(reg: &dyn VolumeClaims, slot: u8, name: &str, turn: u32) -> Result<Claimed> {
    let io = |e| Error::io(format!("claiming volume {name} in the pool's bucket"), e);
    let mine = VolumeClaim {
        name: name.to_string(),
        turn,
        slot,
        writer: reg.writer(),
    };
    let mut slow = String::new();
    for attempt in 0..TRIES {
        let window = Window::open();
        let mut before = reg.list(Some(name)).map_err(io)?;
        if attempt > 0 {
            // Our claim was withdrawn: a listing that still shows it (its DELETE not seen
            // yet, or failed) must not make it the winner, least of all ours.
            before.retain(|c| *c != mine);
        }
        if let Some(w) = VolumeClaim::winner(&before).filter(|w| w.turn >= turn) {
            if w.slot == slot {
                return Ok(Claimed::Won(w.clone())); // ours already (an earlier writer of this slot)
            }
            return Ok(Claimed::Held(w.clone(), ""));
        }
        if reg.conditional() {
            return claim_by_turn_object(reg, &mine);
        }
        if let Err(e) = reg.put(name, turn) {
            // The PUT may still land after its error: withdraw it (docs/S3.md, assumption 3).
            withdraw(reg, &mine);
            return Err(io(e));
        }
        // The window holds for an adoption too: one from a forgotten host has no hand-over
        // naming this slot, so another host may claim the same turn meanwhile.
        if !window.within(WINDOW_BOUND) {
            slow = window.shown();
            tracing::warn!(
                "claiming volume {name}: listing and putting the claim took {slow} (more than \
                 {WINDOW_BOUND:?}: paused, or a slow store): withdrawn, trying again"
            );
            withdraw(reg, &mine);
            continue;
        }
        if turn > 0 {
            // An adoption: the hand-over named this host's slot and this turn, so no other
            // host claims it, and every other claim of the name is of a lower turn (an
            // adoption from a forgotten host checks its claim afterwards).
            return Ok(Claimed::Won(mine));
        }
        std::thread::sleep(SETTLE);
        let mut after = reg.list(Some(name)).map_err(io)?;
        if !after.contains(&mine) {
            after.push(mine.clone());
        }
        return match VolumeClaim::winner(&after) {
            Some(w) if w.slot != slot => {
                let w = w.clone();
                withdraw(reg, &mine);
                Ok(Claimed::Held(w, RACED_TIMED))
            }
            _ => Ok(Claimed::Won(mine)),
        };
    }
    Err(Error::Busy(format!(
        "claiming volume {name}: listing the claims and putting this host's took more than \
         {WINDOW_BOUND:?} {TRIES} times (the last {slow}): the process was paused or the store is \
         too slow to claim the name safely; try again"
    )))
}

/// Delete this host's claim `mine` (withdrawn, or lost): tried three times, since a claim left
/// behind would name this host as the name's holder to every later claimer.
fn withdraw(reg: &dyn VolumeClaims, mine: &VolumeClaim) {
    let mut last = None;
    for _ in 0..3 {
        match reg.delete(mine) {
            Ok(()) => return,
            Err(e) => last = Some(e),
        }
    }
    if let Some(e) = last {
        tracing::error!(
            "volume {}: this host's withdrawn claim (turn {}) could not be deleted: {e}; it \
             names this host as the holder of the name until it is deleted",
            mine.name,
            mine.turn
        );
    }
}

/// The conditional claim: create the turn object of (name, turn); its creator wins the turn,
/// then puts its claim object for every reader of claims.
fn claim_by_turn_object(reg: &dyn VolumeClaims, mine: &VolumeClaim) -> Result<Claimed> {
    let name = &mine.name;
    let io = |e| Error::io(format!("claiming volume {name} in the pool's bucket"), e);
    match reg.take_turn(name, mine.turn).map_err(io)? {
        Some((slot, _)) if slot == mine.slot => {}
        Some((slot, writer)) => {
            let w = VolumeClaim {
                slot,
                writer,
                ..mine.clone()
            };
            return Ok(Claimed::Held(w, RACED_CONDITIONAL));
        }
        None => {
            return Err(Error::Invalid(format!(
                "claiming volume {name}: its turn object {} is not readable; if no host holds \
                 the volume, delete that object",
                VolumeClaim::turn_object(name, mine.turn)
            )))
        }
    }
    if let Err(e) = reg.put(name, mine.turn) {
        withdraw(reg, mine);
        return Err(io(e));
    }
    Ok(Claimed::Won(mine.clone()))
}
