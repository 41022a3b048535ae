//! Hand-overs between hosts that stop half way, hosts forgotten, and one volume name in two
//! parts (engine::hosts (fold, moves, forget), docs/S3.md "Moving a volume" and "Forgetting a
//! host"), on a directory used as the object store.
//!
//! A kill is simulated by stopping a hand-over at a step (`Pool::stop_handovers_at`: the
//! command fails there and nothing after it runs, no clean-up either) and closing the pool;
//! the durable state is then what a kill -9 after that step leaves (a close also publishes a
//! root, which a kill may or may not have done: the state is one a kill can leave either way).
//! tests/s3/cluster.sh h kills real processes.

use condense_engine::format::hosts::VolumeClaim;
use condense_engine::hosts::SharedPool;
use condense_engine::hosts::{
    STEP_CLAIMED, STEP_COMPLETED, STEP_CREATED, STEP_FILLED, STEP_FIRST_BATCH, STEP_RELEASED,
};
use condense_engine::remote::Durability;
use condense_engine::{InitOptions, Pool};
use std::path::{Path, PathBuf};

#[path = "shared_pool/mod.rs"]
mod shared_pool;
use shared_pool::{block, check, claims_of, conf, open, overwrite, segment_bytes, write, CACHE};

struct Cluster {
    _tmp: tempfile::TempDir,
    store: PathBuf,
    a: PathBuf,
    b: PathBuf,
}

fn cluster() -> Cluster {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = tmp.path().join("store");
    std::fs::create_dir_all(&store).expect("store dir");
    let a = tmp.path().join("a");
    Pool::init_remote(
        &a,
        &conf(&store),
        Durability::Local,
        CACHE,
        &InitOptions {
            segment_bytes_target: 1 << 20,
            ..Default::default()
        },
    )
    .expect("init");
    let b = tmp.path().join("b");
    Pool::join_remote(&b, &conf(&store), CACHE, "host-b", None).expect("join");
    Cluster {
        _tmp: tmp,
        store,
        a,
        b,
    }
}

/// Exactly one owner: `owner` holds `vol` whole and writable, no hand-over of it is
/// unfinished there, the other host deleted its copy, and one claim of it is left.
fn one_owner(store: &Path, owner: &Pool, other: &Pool, vol: &str, tag: u64, blocks: u64) {
    check(owner, vol, tag, blocks);
    assert!(
        owner.hand_over_notes().is_empty(),
        "{:?}",
        owner.hand_over_notes()
    );
    owner
        .volume(vol)
        .expect("volume")
        .write_at(0, &block(tag), false)
        .expect("written by its owner");
    owner.sync_hosts().expect("sync owner");
    let r = other.sync_hosts().expect("sync other");
    assert_eq!(r.volumes_moved_out, 1, "{r:?}");
    assert!(other.volume(vol).is_err(), "the other copy is deleted");
    owner.sync_hosts().expect("sync owner");
    assert_eq!(
        claims_of(store, vol).len(),
        1,
        "{:?}",
        claims_of(store, vol)
    );
}

#[test]
fn an_adopt_stopped_at_any_step_is_finished_by_running_it_again_or_by_a_sync() {
    let c = cluster();
    let a = open(&c.a);
    let mut b = open(&c.b);
    for (i, step) in [
        STEP_CLAIMED,
        STEP_CREATED,
        STEP_FIRST_BATCH,
        STEP_FILLED,
        STEP_COMPLETED,
    ]
    .into_iter()
    .enumerate()
    {
        let vol = format!("vm{step}");
        let tag = 1000 * u64::from(step);
        write(&a, &vol, tag, 64);
        a.move_out_volume(&vol, "host-b").expect("move");
        b.stop_handovers_at(step);
        let e = b
            .adopt_volume(&vol, "first-host")
            .expect_err("stopped half way");
        assert!(e.to_string().contains("stopped at step"), "{e}");
        b.close().expect("close b");
        drop(b);
        b = open(&c.b);
        if (STEP_CREATED..STEP_COMPLETED).contains(&step) {
            // Half made: named, and its writes refused until it is finished.
            let notes = b.hand_over_notes();
            assert!(
                notes
                    .iter()
                    .any(|n| n.contains(&vol) && n.contains("half made")),
                "{notes:?}"
            );
            let refused = b
                .volume(&vol)
                .expect("half made")
                .write_at(0, &block(1), false)
                .expect_err("half made");
            assert!(refused.to_string().contains("half made"), "{refused}");
        }
        if i % 2 == 0 {
            b.adopt_volume(&vol, "first-host").expect("adopt again");
        } else {
            let r = b.sync_hosts().expect("sync b");
            if (STEP_CREATED..STEP_COMPLETED).contains(&step) {
                assert_eq!(r.handovers_finished, vec![vol.clone()], "{r:?}");
            } else if step == STEP_CLAIMED {
                // Nothing was made: the adopt is run again (its claim is reused).
                b.adopt_volume(&vol, "first-host").expect("adopt again");
            }
        }
        one_owner(&c.store, &b, &a, &vol, tag, 64);
    }
}

#[test]
fn a_move_stopped_before_its_root_and_a_clone_stopped_half_way_are_finished() {
    let c = cluster();
    let mut a = open(&c.a);
    let b = open(&c.b);
    write(&a, "vm", 0, 64);
    a.stop_handovers_at(STEP_RELEASED);
    a.move_out_volume("vm", "host-b").expect_err("stopped");
    a.close().expect("close a");
    drop(a);
    a = open(&c.a);
    a.move_out_volume("vm", "host-b")
        .expect("the same move again publishes it");
    a.move_out_volume("vm", "01")
        .expect("by its slot too, the same hand-over");
    b.adopt_volume("vm", "first-host").expect("adopt");
    one_owner(&c.store, &b, &a, "vm", 0, 64);

    // A clone from another host, stopped after its first batch: finished by running it
    // again; one stopped after its volume was made: finished by a sync.
    write(&a, "golden", 500, 64);
    a.close().expect("close a");
    drop(a);
    let mut b = b;
    for (step, by_sync) in [(STEP_FIRST_BATCH, false), (STEP_CREATED, true)] {
        let new = format!("copy{step}");
        b.stop_handovers_at(step);
        b.clone_from_host("first-host", "golden", &new)
            .expect_err("stopped");
        b.close().expect("close b");
        drop(b);
        b = open(&c.b);
        assert!(b.volume(&new).is_ok(), "half made, kept");
        if by_sync {
            let r = b.sync_hosts().expect("sync");
            assert_eq!(r.handovers_finished, vec![new.clone()], "{r:?}");
        } else {
            b.clone_from_host("first-host", "golden", &new)
                .expect("clone again");
        }
        check(&b, &new, 500, 64);
        assert!(b.hand_over_notes().is_empty(), "{:?}", b.hand_over_notes());
        // Another source for a half-made name is refused, not mixed in.
    }
    let refused = b
        .clone_from_host("first-host", "golden", "copy3")
        .expect_err("exists");
    assert!(refused.to_string().contains("copy3"), "{refused}");
}

#[test]
fn a_forgotten_host_frees_condemned_segments_its_volumes_are_adopted_and_its_part_reclaimed() {
    let c = cluster();
    let a = open(&c.a);
    let b = open(&c.b);
    // a's GC condemns a segment that b must let go of.
    write(&a, "scratch", 7000, 256);
    a.close().expect("close a");
    drop(a);
    let a = open(&c.a);
    write(&a, "keep", 8000, 64);
    b.sync_hosts().expect("b folds a");
    // b's volumes: one it keeps, one in a segment of its own that nobody else names.
    write(&b, "bv", 100, 64);
    b.close().expect("close b");
    drop(b);
    let b = open(&c.b);
    write(&b, "bw", 20_000, 256);
    b.close().expect("close b");
    drop(b);
    a.delete_volume("scratch").expect("delete");
    a.flush().expect("flush");
    let gc = a.gc(1).expect("gc");
    assert!(gc.segments_condemned > 0, "{gc:?}");
    let r = a.sync_hosts().expect("sync a");
    assert!(r.segments_condemned > 0, "b never acknowledged: {r:?}");
    // Forgotten (its lease was released by its close): a's condemned segments go at once.
    let f = a.forget_host("host-b", false, false).expect("forget");
    assert_eq!(f.slot, 1);
    assert_eq!(f.volumes, vec!["bv".to_string(), "bw".to_string()]);
    let r = a.sync_hosts().expect("sync a");
    assert!(r.segments_deleted > 0, "{r:?}");
    assert_eq!(r.segments_condemned, 0, "{r:?}");
    assert!(r.peers[0].forgotten, "{r:?}");
    // b's volume is adopted without a hand-over, one turn above b's claim.
    a.adopt_volume("bv", "host-b")
        .expect("adopt from a forgotten host");
    check(&a, "bv", 100, 64);
    assert_eq!(claims_of(&c.store, "bv"), vec![(0, 1), (1, 0)]);
    // Reclaim: b's segments no chunk of a names are deleted; bv still reads.
    let before = segment_bytes(&c.store.join("hosts/01"), false);
    a.forget_host("01", false, true).expect("reclaim");
    let r = a.sync_hosts().expect("sync a");
    assert!(r.reclaimed_segments > 0, "{r:?}");
    let after = segment_bytes(&c.store.join("hosts/01"), false);
    assert_eq!(before - after, r.reclaimed_bytes, "{r:?}");
    assert!(after > 0, "the segment of bv is kept");
    let refused = a.adopt_volume("bw", "host-b").expect_err("given up");
    assert!(refused.to_string().contains("given up"), "{refused}");
    a.close().expect("close a");
    drop(a);
    let a = open(&c.a);
    check(&a, "bv", 100, 64);
    check(&a, "keep", 8000, 64);
    let v = a.verify(&|_, _| {}).expect("verify");
    assert!(v.bad_chunks.is_empty(), "{:?}", v.bad_chunks);
    // b comes back: it refuses to sync.
    let b = open(&c.b);
    let e = b.sync_hosts().expect_err("forgotten");
    assert!(e.to_string().contains("forgotten"), "{e}");
}

#[test]
fn a_live_host_is_forgotten_only_by_force() {
    let c = cluster();
    let a = open(&c.a);
    let b = open(&c.b);
    let e = a
        .forget_host("host-b", false, false)
        .expect_err("its lease is alive");
    assert!(e.to_string().contains("--force"), "{e}");
    assert!(a.forgotten_hosts().is_empty());
    a.forget_host("host-b", true, false).expect("forced");
    b.sync_hosts().expect_err("b finds itself forgotten");
}

#[test]
fn one_name_in_two_parts_is_reported_and_the_losers_writes_refused() {
    let c = cluster();
    let a = open(&c.a);
    let b = open(&c.b);
    write(&a, "dup", 0, 16);
    // The claim lost (as a race the claim protocol did not see would lose it): b makes the
    // name too.
    let claim_dir = c
        .store
        .join(VolumeClaim::prefix(Some("dup")).trim_end_matches('/'));
    std::fs::remove_dir_all(&claim_dir).expect("remove a's claim");
    write(&b, "dup", 50, 16);
    b.sync_hosts().expect("sync b"); // publishes b's dup
    let r = a.sync_hosts().expect("sync a");
    assert_eq!(r.name_conflicts.len(), 1, "{r:?}");
    assert!(r.name_conflicts[0].refused_here, "{r:?}");
    assert_eq!(r.name_conflicts[0].winner_slot, 1);
    let refused = a
        .volume("dup")
        .expect("dup")
        .write_at(0, &block(3), false)
        .expect_err("b won the name");
    assert!(refused.to_string().contains("host-b"), "{refused}");
    assert!(
        a.hand_over_notes().iter().any(|n| n.contains("dup")),
        "{:?}",
        a.hand_over_notes()
    );
    assert_eq!(
        a.hand_over_counts(),
        (0, 1),
        "the metrics' count of names lost"
    );
    let r = b.sync_hosts().expect("sync b");
    assert_eq!(r.name_conflicts.len(), 1, "{r:?}");
    assert!(!r.name_conflicts[0].refused_here, "{r:?}");
    b.volume("dup")
        .expect("dup")
        .write_at(0, &block(4), false)
        .expect("b writes it");
    // a deletes its copy: the conflict is gone.
    a.delete_volume("dup").expect("delete");
    let r = a.sync_hosts().expect("sync a");
    assert!(r.name_conflicts.is_empty(), "{r:?}");
    assert!(a.hand_over_notes().is_empty(), "{:?}", a.hand_over_notes());
    assert_eq!(a.hand_over_counts(), (0, 0));
}

/// A moved volume that its new host deletes before the old host's next sync: the old host
/// still deletes its released copy (its new host's root records the adoption of that
/// hand-over's turn, though it holds the volume no more). nemesis.sh found the copy left for
/// ever when the old host waited for the volume itself in the new host's root.
#[test]
fn a_moved_volume_deleted_by_its_new_host_is_not_left_on_the_old_one() {
    let c = cluster();
    let a = open(&c.a);
    let b = open(&c.b);
    write(&a, "vm", 0, 16);
    a.move_out_volume("vm", "host-b").expect("move");
    assert_eq!(a.hand_over_counts(), (1, 0), "handed over, still here");
    b.adopt_volume("vm", "first-host").expect("adopt");
    b.delete_volume("vm").expect("deleted on its new host");
    b.sync_hosts().expect("sync b");
    let r = a.sync_hosts().expect("sync a");
    assert_eq!(r.volumes_moved_out, 1, "{r:?}");
    assert!(a.volume("vm").is_err(), "the released copy is deleted");
    assert_eq!(a.hand_over_counts(), (0, 0));
}

/// A volume moved a → b → a → b ends on b, whole, whatever syncs ran between the moves: a
/// host that adopts a volume it once handed away forgets that old hand-over. nemesis.sh
/// (seed 388214) found b's sync deleting the volume it had just adopted back, since its
/// record of handing it to a was still there and a's root recorded that adoption.
#[test]
fn a_volume_moved_back_and_forth_stays_on_its_last_host() {
    for sync_between in [false, true] {
        let c = cluster();
        let a = open(&c.a);
        let b = open(&c.b);
        write(&a, "vm", 0, 16);
        a.move_out_volume("vm", "host-b").expect("move to b");
        b.adopt_volume("vm", "first-host").expect("adopt on b");
        b.sync_hosts().expect("sync b");
        a.sync_hosts().expect("sync a: deletes its copy");
        overwrite(&b, "vm", 100, 16);
        b.move_out_volume("vm", "first-host")
            .expect("move back to a");
        a.adopt_volume("vm", "host-b").expect("adopt on a");
        if sync_between {
            a.sync_hosts().expect("sync a");
            b.sync_hosts().expect("sync b: deletes its copy");
        }
        overwrite(&a, "vm", 200, 16);
        a.move_out_volume("vm", "host-b").expect("move to b again");
        b.adopt_volume("vm", "first-host")
            .unwrap_or_else(|e| panic!("adopt on b again (sync between: {sync_between}): {e}"));
        for _ in 0..2 {
            b.sync_hosts().expect("sync b");
            a.sync_hosts().expect("sync a");
        }
        assert!(
            b.volume("vm").is_ok(),
            "b keeps the volume it adopted last (sync between: {sync_between})"
        );
        check(&b, "vm", 200, 16);
        assert!(a.volume("vm").is_err(), "a deleted its copy");
        assert_eq!(b.hand_over_counts(), (0, 0), "{:?}", b.hand_over_notes());
        assert_eq!(a.hand_over_counts(), (0, 0), "{:?}", a.hand_over_notes());
        assert_eq!(
            claims_of(&c.store, "vm").len(),
            1,
            "{:?}",
            claims_of(&c.store, "vm")
        );
    }
}
