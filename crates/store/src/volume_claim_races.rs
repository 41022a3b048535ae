//! The volume-claim protocol raced by two hosts, one of them paused between its LIST and its
//! PUT (crate::remote::claim_race, docs/S3.md "Lease: claims"), on a store with
//! conditional PUT and on one without: exactly one host owns a name.

use crate::remote::claim_race::{claim_registry, conf, race, two_handles};
use crate::volume_claims::{claim_name, Claimed};
use crate::{Error, Result};
use condense_object_store::conformance::Faulty;
use std::sync::Arc;

/// Slot 1 paused after its LIST, slot 2 claiming meanwhile: slot 2 owns "vm1" and slot 1 sees
/// it held. The paused host has the lower slot: a claim it puts after the other won would win
/// the claim rule, so both would hold the name. `refuse_deletes`: the paused host's
/// withdrawal fails, so its retry lists its own withdrawn claim.
fn volume_claim_race(conditional: bool, refuse_deletes: bool) -> Result<()> {
    let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
    let c = conf(dir.path());
    let registry = |store: Arc<Faulty>, slot: u8| claim_registry(&c, store, slot);
    let handles = two_handles(dir.path(), conditional)?;
    handles.0.refuse_deletes(refuse_deletes);
    let (p, o) = race(
        handles,
        |h| claim_name(&registry(h, 1), 1, "vm1", 0),
        |h| claim_name(&registry(h, 2), 2, "vm1", 0),
    );
    let (p, o) = (p?, o?);
    assert!(matches!(&o, Claimed::Won(c) if c.slot == 2), "{o:?}");
    assert!(
        matches!(&p, Claimed::Held(w, _) if w.slot == 2),
        "the paused host must not hold the name too: {p:?}"
    );
    Ok(())
}

#[test]
fn a_paused_volume_claim_never_makes_two_owners_without_conditional_put() -> Result<()> {
    volume_claim_race(false, false)
}

#[test]
fn a_paused_volume_claim_never_makes_two_owners_with_conditional_put() -> Result<()> {
    volume_claim_race(true, false)
}

/// The paused host's withdrawn claim, still listed, wins the claim rule (the lower slot): its
/// retry must still not take the name the other host won meanwhile (nemesis.sh window 1 found
/// a retry that did).
#[test]
fn a_withdrawn_claim_still_listed_does_not_win_the_retry() -> Result<()> {
    volume_claim_race(false, true)
}

#[test]
fn a_deleted_claim_frees_its_turn_object_for_the_next_host() -> Result<()> {
    let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
    let c = conf(dir.path());
    let (a, b) = two_handles(dir.path(), true)?;
    let registry = |store: Arc<Faulty>, slot: u8| claim_registry(&c, store, slot);
    let (ra, rb) = (registry(a, 1), registry(b, 2));
    let Claimed::Won(mine) = claim_name(&ra, 1, "vm1", 0)? else {
        panic!("the first claim of a name lost");
    };
    assert!(dir.path().join("volumes/766d31/00000000").is_file());
    assert!(matches!(claim_name(&rb, 2, "vm1", 0)?, Claimed::Held(w, _) if w.slot == 1));
    // Slot 2 may not delete slot 1's turn object through a claim of its own writer.
    use crate::io::VolumeClaims;
    rb.delete(&condense_format::hosts::VolumeClaim {
        slot: 2,
        writer: 0x102,
        ..mine.clone()
    })
    .map_err(|e| Error::io("delete", e))?;
    assert!(dir.path().join("volumes/766d31/00000000").is_file());
    ra.delete(&mine).map_err(|e| Error::io("delete", e))?;
    assert!(!dir.path().join("volumes/766d31/00000000").exists());
    assert!(matches!(claim_name(&rb, 2, "vm1", 0)?, Claimed::Won(w) if w.slot == 2));
    Ok(())
}
