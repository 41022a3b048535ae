//! A pool several hosts share (engine::hosts, docs/S3.md "Many hosts"), on a directory used as
//! the object store: a second host joins, folds the first host's chunks in and stores nothing
//! of data the first host holds; blocks both stored at once are merged into the lower slot's
//! copy; a segment the first host's GC emptied is kept until the second host let it go, then
//! deleted, and every block of both hosts still reads back, also after a reopen; a host
//! with the sparse dedup index folds a peer's chunks within its budget.

use condense_engine::hosts::SharedPool;
use condense_engine::index::{IndexSetting, SETTING_KEY};
use condense_engine::remote::{self, Durability};
use condense_engine::{InitOptions, Pool};

#[path = "shared_pool/mod.rs"]
mod shared_pool;
use condense_engine::OpenOptions;
use shared_pool::{block, check, claims_of, conf, open, segment_bytes, write, BS, CACHE};
use std::path::{Path, PathBuf};

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
    let (slot, url) = Pool::join_remote(&b, &conf(&store), CACHE, "host-b", None).expect("join");
    assert_eq!(slot, 1, "the first host to join takes slot 1");
    assert!(url.ends_with("/hosts/01"), "{url}");
    Cluster {
        _tmp: tmp,
        store,
        a,
        b,
    }
}

#[test]
fn a_joined_host_stores_nothing_the_first_host_holds() {
    let c = cluster();
    let a = open(&c.a);
    write(&a, "golden", 0, 512);
    a.close().expect("close a"); // a clean close uploads everything and puts a root
    let b = open(&c.b);
    let r = b.sync_hosts().expect("sync");
    assert_eq!(r.slot, 1);
    assert_eq!(r.peers.len(), 1, "{r:?}");
    assert_eq!(r.peers[0].chunks_folded, 512, "{r:?}");
    let before = segment_bytes(&c.store.join("hosts"), false);
    write(&b, "clone", 0, 512);
    b.close().expect("close b");
    drop(b);
    let stored = segment_bytes(&c.store.join("hosts"), false) - before;
    assert!(
        stored < 64 << 10,
        "host b stored {stored} bytes of segments for data host a holds"
    );
    // Reopened, host b reads host a's records (attached at open).
    let b = open(&c.b);
    check(&b, "clone", 0, 512);
    let v = b.verify(&|_, _| {}).expect("verify");
    assert!(v.bad_chunks.is_empty(), "{:?}", v.bad_chunks);
    // The first host sees host b as a member; its listing of its own tree leaves b's out.
    assert_eq!(
        remote::list_members(&conf(&c.store))
            .expect("members")
            .iter()
            .map(|m| (m.slot, m.host.clone()))
            .collect::<Vec<_>>(),
        vec![(1, "host-b".to_string())]
    );
}

/// The fold runs in bounded steps (engine::hosts::fold "Bounded steps"), the state lock
/// released between them: a host writing all the while, half of it content the peer holds,
/// loses nothing, and each of the peer's chunks is either added or merged into, exactly once.
#[test]
fn a_fold_in_steps_beside_writes_adds_or_merges_each_chunk_once() {
    const PEER_BLOCKS: u64 = 10_000; // more than one window of chunk-table pages
    const WRITES: u64 = 2_000;
    let c = cluster();
    let a = open(&c.a);
    write(&a, "golden", 100_000, PEER_BLOCKS);
    a.close().expect("close a");
    let b = open(&c.b);
    b.create_volume("busy", WRITES * BS as u64)
        .expect("create busy");
    // Block i of busy: the peer's content for even i (a merge or a dedup, as the fold and the
    // write fall), new content for odd i.
    let tag = |i: u64| {
        if i.is_multiple_of(2) {
            100_000 + i * 3
        } else {
            900_000 + i
        }
    };
    let report = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let h = b.volume("busy").expect("busy");
            for i in 0..WRITES {
                h.write_at(i * BS as u64, &block(tag(i)), false)
                    .expect("write beside the fold");
            }
            b.flush().expect("flush");
        });
        let r = b.sync_hosts().expect("sync beside writes");
        writer.join().expect("writer");
        r
    });
    let p = &report.peers[0];
    assert_eq!(
        p.chunks_folded + p.chunks_merged,
        PEER_BLOCKS,
        "each of the peer's chunks added or merged once: {report:?}"
    );
    assert!(p.progress.through >= PEER_BLOCKS, "{report:?}");
    assert_eq!(b.hosts_state().2.get(&0).copied(), Some(p.progress));
    for i in 0..WRITES {
        let mut buf = vec![0u8; BS];
        b.volume("busy")
            .expect("busy")
            .read_at(i * BS as u64, &mut buf)
            .expect("read busy");
        assert!(buf == block(tag(i)), "busy block {i} as written");
    }
    // Nothing is left to fold, and the peer's content is deduplicated against.
    let again = b.sync_hosts().expect("sync again");
    assert_eq!(again.peers[0].chunks_folded, 0, "{again:?}");
    assert_eq!(again.peers[0].chunks_merged, 0, "{again:?}");
    b.close().expect("close b"); // busy's new blocks uploaded
    drop(b);
    let b = open(&c.b);
    let before = segment_bytes(&c.store.join("hosts"), false);
    write(&b, "copy", 100_000, PEER_BLOCKS);
    b.close().expect("close b");
    drop(b);
    let stored = segment_bytes(&c.store.join("hosts"), false) - before;
    assert!(
        stored < 64 << 10,
        "host b stored {stored} bytes of segments for data host a holds"
    );
    let b = open(&c.b);
    check(&b, "copy", 100_000, PEER_BLOCKS);
    let v = b.verify(&|_, _| {}).expect("verify");
    assert!(v.bad_chunks.is_empty(), "{:?}", v.bad_chunks);
}

/// Both hosts store the same 768 blocks (a's `va`, b's `vb`) before either folded the other
/// in; then a publishes its chunks and b's fold merges all of them into a's copies.
fn stored_twice_then_merged(a: &Pool, b: &Pool) {
    write(a, "va", 1000, 768);
    write(b, "vb", 1000, 768);
    a.sync_hosts().expect("sync a"); // publishes a's chunks in its root
    let r = b.sync_hosts().expect("sync b");
    assert_eq!(r.peers[0].chunks_merged, 768, "{r:?}");
}

#[test]
fn blocks_stored_twice_merge_and_a_condemned_segment_waits_for_every_host() {
    let c = cluster();
    let a = open(&c.a);
    let b = open(&c.b);
    stored_twice_then_merged(&a, &b);
    // b's own copies are dead space now: its GC empties them (condemned: a may name them).
    let g = b.gc(50).expect("gc b");
    assert!(g.segments_condemned > 0, "{g:?}");
    check(&b, "vb", 1000, 768);
    // Host a deletes its volume and collects: its segments are condemned, not deleted.
    let segs_before = segment_bytes(&c.store, true);
    a.delete_volume("va").expect("delete");
    let g = a.gc(0).expect("gc a");
    assert!(g.segments_condemned > 0, "{g:?}");
    assert_eq!(g.segments_removed, 0, "{g:?}");
    assert_eq!(
        segment_bytes(&c.store, true),
        segs_before,
        "nothing deleted yet"
    );
    // Until b let go, a's sync deletes nothing.
    assert_eq!(a.sync_hosts().expect("sync a").segments_deleted, 0);
    check(&b, "vb", 1000, 768);
    let r = b.sync_hosts().expect("sync b");
    assert!(r.peers[0].chunks_let_go >= 768, "{r:?}");
    assert!(
        r.segments_deleted > 0,
        "a let b's condemned segment go: {r:?}"
    );
    let r = a.sync_hosts().expect("sync a");
    assert!(r.segments_deleted > 0, "{r:?}");
    assert_eq!(r.segments_condemned, 0, "{r:?}");
    assert!(segment_bytes(&c.store, true) < segs_before);
    check(&b, "vb", 1000, 768);
    b.close().expect("close b");
    drop(b);
    let b = open(&c.b);
    check(&b, "vb", 1000, 768);
    let v = b.verify(&|_, _| {}).expect("verify");
    assert!(v.bad_chunks.is_empty(), "{:?}", v.bad_chunks);
}

#[test]
fn a_volume_cloned_from_another_host_and_moved_between_hosts_reads_back() {
    let c = cluster();
    let a = open(&c.a);
    let b = open(&c.b);
    write(&a, "golden", 0, 300);
    a.create_snapshot("golden", "v1").expect("snapshot");
    write(&a, "vm", 5000, 200);
    a.sync_hosts().expect("sync a"); // its root now has both
                                     // A clone of another host's snapshot names that host's records: nothing is stored.
    let before = segment_bytes(&c.store.join("hosts"), false);
    let r = b
        .clone_from_host("first-host", "golden@v1", "web1")
        .expect("clone");
    assert_eq!(r.data_blocks, 300, "{r:?}");
    check(&b, "web1", 0, 300);
    let missing = b
        .clone_from_host("first-host", "nope", "x")
        .expect_err("no such volume");
    assert!(missing.to_string().contains("nope"), "{missing}");
    // Move vm from a to b: a refuses its writes at once, b adopts what a flushed.
    let m = a.move_out_volume("vm", "host-b").expect("move");
    assert_eq!(m.slot, 1);
    let h = a.volume("vm").expect("volume");
    let refused = h
        .write_at(0, &block(1), false)
        .expect_err("moved: read-only here");
    assert!(
        refused.to_string().contains("moved to host host-b"),
        "{refused}"
    );
    let wrong = a
        .adopt_volume("golden", "host-b")
        .expect_err("nothing handed to a");
    assert!(wrong.to_string().contains("has not handed"), "{wrong}");
    let r = b.adopt_volume("vm", "first-host").expect("adopt");
    assert_eq!(r.clone.map(|c| c.data_blocks), Some(200));
    check(&b, "vm", 5000, 200);
    write_more(&b, "vm", 7000); // written on b from now on
    b.flush().expect("flush");
    b.sync_hosts().expect("sync b"); // publishes the adoption
    let r = a.sync_hosts().expect("sync a");
    assert_eq!(r.volumes_moved_out, 1, "{r:?}");
    assert!(a.volume_id("vm").is_err(), "a deleted its copy");
    let stored = segment_bytes(&c.store.join("hosts"), false) - before;
    assert!(
        stored < 64 << 10,
        "host b stored {stored} bytes for a clone and a move"
    );
    check(&b, "web1", 0, 300);
    b.close().expect("close b");
    drop(b);
    let b = open(&c.b);
    check(&b, "web1", 0, 300);
    let h = b.volume("vm").expect("vm");
    let mut buf = vec![0u8; BS];
    h.read_at(0, &mut buf).expect("read");
    assert!(buf == block(7000), "block 0 as b wrote it");
}

/// Block 0 of `vol` written again with tag `tag`.
fn write_more(pool: &Pool, vol: &str, tag: u64) {
    pool.volume(vol)
        .expect("volume")
        .write_at(0, &block(tag), false)
        .expect("write");
}

#[test]
fn an_encrypted_pool_is_joined_with_its_key_and_shares_records() {
    use condense_engine::UserKey;
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = tmp.path().join("store");
    std::fs::create_dir_all(&store).expect("store dir");
    let (a_dir, b_dir) = (tmp.path().join("a"), tmp.path().join("b"));
    let key = || Some(UserKey::key([7; 32]));
    Pool::init_remote(
        &a_dir,
        &conf(&store),
        Durability::Local,
        CACHE,
        &InitOptions {
            segment_bytes_target: 1 << 20,
            encryption: key(),
            ..Default::default()
        },
    )
    .expect("init");
    let wrong = Pool::join_remote(
        &b_dir,
        &conf(&store),
        CACHE,
        "b",
        Some(&UserKey::key([8; 32])),
    )
    .expect_err("a wrong key joins nothing");
    assert!(
        !b_dir.exists(),
        "no local directory made for a refused join: {wrong}"
    );
    Pool::join_remote(&b_dir, &conf(&store), CACHE, "b", key().as_ref()).expect("join");
    let open_key = |p: &Path| {
        Pool::open_path(
            p,
            OpenOptions {
                destage_in_background: false,
                key: key(),
                ..Default::default()
            },
        )
        .expect("open")
    };
    let a = open_key(&a_dir);
    write(&a, "golden", 0, 256);
    a.sync_hosts().expect("sync a");
    let b = open_key(&b_dir);
    let r = b
        .clone_from_host("first-host", "golden", "copy")
        .expect("clone");
    assert_eq!(r.data_blocks, 256);
    check(&b, "copy", 0, 256);
    let v = b.verify(&|_, _| {}).expect("verify");
    assert!(v.bad_chunks.is_empty(), "{:?}", v.bad_chunks);
}

/// GC across hosts as a race: host a overwrites, deletes and collects its volumes in a loop
/// (condemning segments), while host b keeps cloning a's newest volume, writing the same blocks
/// itself (merges) and folding a in. Every clone b made must read back whole at every moment,
/// and after the race, once both let go, nothing b names is gone.
#[test]
fn gc_on_one_host_while_another_clones_and_folds_never_deletes_what_it_names() {
    let c = cluster();
    let a = open(&c.a);
    let b = open(&c.b);
    let rounds = 12u64;
    let mut clones: Vec<(String, u64)> = Vec::new();
    for r in 0..rounds {
        // a: a new generation of its volume, the previous one deleted, then collected.
        let tag = 100_000 * (r + 1);
        write(&a, &format!("gen{r}"), tag, 200);
        if r > 0 {
            a.delete_volume(&format!("gen{}", r - 1)).expect("delete");
        }
        a.sync_hosts().expect("sync a");
        // b: clones a's newest, writes half of it again itself (merged at its next fold).
        let name = format!("c{r}");
        b.clone_from_host("first-host", &format!("gen{r}"), &name)
            .expect("clone");
        write(&b, &format!("own{r}"), tag, 100);
        clones.push((name, tag));
        // GC on a at every round, and on b every other: condemned segments pile up until
        // the other host let go.
        a.gc(10).expect("gc a");
        if r % 2 == 1 {
            b.gc(10).expect("gc b");
        }
        b.sync_hosts().expect("sync b");
        for (n, t) in &clones {
            check(&b, n, *t, 200);
        }
    }
    for _ in 0..2 {
        a.sync_hosts().expect("sync a");
        b.sync_hosts().expect("sync b");
    }
    for (n, t) in &clones {
        check(&b, n, *t, 200);
    }
    for p in [&a, &b] {
        let v = p.verify(&|_, _| {}).expect("verify");
        assert!(v.bad_chunks.is_empty(), "{:?}", v.bad_chunks);
    }
    let (_, waiting, _) = a.hosts_state();
    assert_eq!(
        waiting, 0,
        "every condemned segment of a was deleted once b let go"
    );
}

#[test]
fn two_hosts_racing_for_one_volume_name_exactly_one_wins() {
    let c = cluster();
    let a = open(&c.a);
    let b = open(&c.b);
    let rounds = 6;
    let mut wins = [0u32; 2];
    for r in 0..rounds {
        let name = format!("r{r}");
        let barrier = std::sync::Barrier::new(2);
        let (ra, rb) = std::thread::scope(|s| {
            let ta = s.spawn(|| {
                barrier.wait();
                a.create_volume(&name, 1 << 20)
            });
            let tb = s.spawn(|| {
                barrier.wait();
                b.create_volume(&name, 1 << 20)
            });
            (ta.join().expect("thread a"), tb.join().expect("thread b"))
        });
        match (&ra, &rb) {
            (Ok(()), Err(e)) | (Err(e), Ok(())) => {
                assert!(e.to_string().contains("is held by host"), "round {r}: {e}");
            }
            _ => panic!("round {r}: not exactly one winner: a {ra:?}, b {rb:?}"),
        }
        let winner = usize::from(ra.is_err());
        wins[winner] += 1;
        // The loser withdrew its claim: one claim, the winner's.
        assert_eq!(
            claims_of(&c.store, &name),
            vec![(0, winner as u8)],
            "round {r}"
        );
        let (w, l) = if winner == 0 { (&a, &b) } else { (&b, &a) };
        assert!(w.volume_id(&name).is_ok() && l.volume_id(&name).is_err());
    }
    // A name the other host deleted is free again, and its claim is gone.
    let (holder, other) = if wins[0] > 0 { (&a, &b) } else { (&b, &a) };
    let name = (0..rounds)
        .map(|r| format!("r{r}"))
        .find(|n| holder.volume_id(n).is_ok())
        .expect("a round the holder won");
    holder.delete_volume(&name).expect("delete");
    // Its claim stays until a root holds the deletion (the next sync or close).
    assert_eq!(claims_of(&c.store, &name).len(), 1);
    holder.sync_hosts().expect("sync");
    assert!(claims_of(&c.store, &name).is_empty());
    other
        .create_volume(&name, 1 << 20)
        .expect("the name is free");
    let refused = holder
        .create_volume(&name, 1 << 20)
        .expect_err("held by the other host now");
    assert!(refused.to_string().contains("is held by host"), "{refused}");
}

#[test]
fn a_moved_volume_is_claimed_one_turn_up_and_a_dead_hosts_volume_is_taken_over() {
    let c = cluster();
    let a = open(&c.a);
    let b = open(&c.b);
    // A volume made before the pool was shared has no claim until its host's next sync.
    write(&a, "vm", 0, 64);
    write(&b, "solo", 900, 64);
    assert_eq!(claims_of(&c.store, "vm"), vec![(0, 0)]);
    a.move_out_volume("vm", "host-b").expect("move");
    b.adopt_volume("vm", "first-host").expect("adopt");
    assert_eq!(claims_of(&c.store, "vm"), vec![(0, 0), (1, 1)]);
    b.sync_hosts().expect("sync b");
    a.sync_hosts().expect("sync a"); // deletes its copy, and its claim with it
    assert_eq!(claims_of(&c.store, "vm"), vec![(1, 1)]);
    let refused = a.create_volume("vm", 1 << 20).expect_err("b holds vm");
    assert!(refused.to_string().contains("host-b"), "{refused}");
    // b goes away without handing anything over; a takes its volumes (its lease was
    // released here: a crashed host's expires first, tests/s3/cluster.sh g).
    write_more(&b, "solo", 901);
    b.flush().expect("flush b");
    b.close().expect("close b");
    drop(b);
    let took = a
        .take_over_volumes(
            &["solo".to_string(), "vm".to_string()],
            "host-b",
            std::time::Duration::from_secs(5),
        )
        .expect("take over");
    assert_eq!(took.len(), 2);
    check(&a, "vm", 0, 64);
    let h = a.volume("solo").expect("solo");
    let mut buf = vec![0u8; BS];
    h.read_at(0, &mut buf).expect("read");
    assert!(buf == block(901), "solo's block 0 as b flushed it");
    assert_eq!(claims_of(&c.store, "solo"), vec![(0, 1), (1, 0)]);
    write_more(&a, "solo", 902); // written on a from now on
    a.sync_hosts().expect("sync a");
    // b comes back: it may not write them, and deletes its copies at its sync.
    let b = open(&c.b);
    let refused = b
        .volume("solo")
        .expect("still listed on b")
        .write_at(0, &block(1), false)
        .expect_err("moved");
    assert!(refused.to_string().contains("moved to host"), "{refused}");
    let r = b.sync_hosts().expect("sync b");
    assert_eq!(r.volumes_moved_out, 2, "{r:?}");
    assert_eq!(claims_of(&c.store, "solo"), vec![(1, 0)]);
    assert_eq!(claims_of(&c.store, "vm"), vec![(2, 0)]);
}

/// Many hosts with the sparse dedup index (issue 43, "Many hosts"): a host folds a peer's
/// chunks into its own chunk table and index at a sync; with a sparse index that index stays
/// within the host's budget however many chunks the peer holds, and data the peer holds,
/// written on this host after the fold, is still found (through the hooks and the locality
/// cache over the folded chunks, which keep the peer's write order).
/// Its locality cache (~38 pages) holds what one 8 MiB write loads (~24 pages). At 256K (~19
/// pages) a write's second lookup of a block misses pages its first loaded: 2.6 % of these
/// blocks were stored again (the write path's two lookups, engine pool/write.rs).
const SPARSE_BUDGET: u64 = 512 << 10;
/// The peer's chunks: a dense index of them takes more than the budget.
const SPARSE_PEER_BLOCKS: u64 = 60_000;

/// Volume `vol` of `blocks` blocks of tags from `first`, in writes of 8 MiB (an import's).
fn write_in_pieces(pool: &Pool, vol: &str, first: u64, blocks: u64) {
    pool.create_volume(vol, blocks * BS as u64).expect("create");
    let h = pool.volume(vol).expect("volume");
    for start in (0..blocks).step_by(2048) {
        let end = (start + 2048).min(blocks);
        let data: Vec<u8> = (start..end).flat_map(|b| block(first + b)).collect();
        h.write_at(start * BS as u64, &data, false).expect("write");
    }
    pool.flush().expect("flush");
}

/// Two hosts: the first writes volume "golden" of `blocks` blocks (tags from 0) and closes;
/// the second, opened and returned, has a sparse index of `budget` bytes (built at its first
/// write). The temporary directory holds both.
fn sparse_host_beside(blocks: u64, budget: u64) -> (tempfile::TempDir, std::sync::Arc<Pool>) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = tmp.path().join("store");
    std::fs::create_dir_all(&store).expect("store dir");
    let (pa, pb) = (tmp.path().join("a"), tmp.path().join("b"));
    let opts = InitOptions {
        segment_bytes_target: 4 << 20,
        ..Default::default()
    };
    Pool::init_remote(&pa, &conf(&store), Durability::Local, CACHE, &opts).expect("init");
    Pool::join_remote(&pb, &conf(&store), CACHE, "host-b", None).expect("join");
    let a = open(&pa);
    write_in_pieces(&a, "golden", 0, blocks);
    a.close().expect("close a");
    drop(a);
    let b = open(&pb);
    let sparse = IndexSetting::Sparse { budget };
    b.meta_put(SETTING_KEY, Some(&sparse.encode()))
        .expect("setting");
    b.close().expect("close b");
    drop(b);
    (tmp, open(&pb))
}

#[test]
fn a_sparse_host_folds_a_peers_chunks_within_its_budget_and_finds_them() {
    let (_tmp, b) = sparse_host_beside(SPARSE_PEER_BLOCKS, SPARSE_BUDGET);
    let data = || b.stats().expect("stats").data_bytes;
    let empty = data();
    write_in_pieces(&b, "own", 1_000_000, 1_000); // builds the sparse index at the first write
    let own = data() - empty;
    let r = b.sync_hosts().expect("sync");
    assert_eq!(r.peers[0].chunks_folded, SPARSE_PEER_BLOCKS, "{r:?}");
    let s = b.stats().expect("stats");
    assert_eq!(s.dedup_index_mode, "sparse");
    // `unique_chunks` counts this host's own records; the folded ones are indexed too: the
    // hooks (1 in 64) of both.
    assert_eq!(s.unique_chunks, 1_000);
    assert!(
        s.dedup_index_entries > SPARSE_PEER_BLOCKS / 64 / 2,
        "{} hooks: the folded chunks are not indexed",
        s.dedup_index_entries
    );
    eprintln!(
        "sparse host b after the fold: index {} bytes, {} hooks, {} hooks dropped",
        s.dedup_index_bytes, s.dedup_index_entries, s.dedup_index_hooks_dropped
    );
    assert!(
        s.dedup_index_bytes <= SPARSE_BUDGET,
        "{} bytes of index for a budget of {SPARSE_BUDGET}",
        s.dedup_index_bytes
    );
    let dense = condense_engine::dedup_index::projected_ram_bytes(SPARSE_PEER_BLOCKS + 1_000);
    assert!(dense > SPARSE_BUDGET, "a dense index would take {dense}");
    eprintln!("a dense index of them: {dense} bytes");

    // The peer's data written on this host: found from the first hook on, not stored again.
    let before = data();
    write_in_pieces(&b, "copy", 0, SPARSE_PEER_BLOCKS);
    let stored = data() - before;
    eprintln!("the peer's {SPARSE_PEER_BLOCKS} blocks written on b: {stored} bytes stored; 1000 own blocks took {own}");
    // At most 1 % of what storing them all would take (1000 blocks took `own`).
    assert!(
        stored * 100 <= own * (SPARSE_PEER_BLOCKS / 1_000),
        "{stored} bytes stored for {SPARSE_PEER_BLOCKS} blocks the peer holds ({own} per 1000 new)"
    );
    check(&b, "copy", 0, SPARSE_PEER_BLOCKS);
    assert!(b.stats().expect("stats").dedup_index_bytes <= SPARSE_BUDGET);
}

/// What a sparse host's fold misses (its own copy of a peer's data, written in another
/// order) becomes a pair the merge pass finds; as at the fold, the lower slot's copy stays:
/// this host's own copy is made the forward, so its records are dead and GC takes them back,
/// where forwarding the peer's newer chunk to it would keep both hosts' copies.
#[test]
fn the_merge_pass_keeps_the_lower_slots_copy_of_what_the_fold_missed() {
    const N: u64 = 40_000;
    let (_tmp, b) = sparse_host_beside(N, condense_engine::sparse_index::MIN_BUDGET);
    // The same blocks in another order (7919 is prime, so i -> 7919 i mod N is a permutation):
    // no run of the peer's write order is a run here.
    let tag = |i: u64| i * 7919 % N;
    b.create_volume("mine", N * BS as u64).expect("create");
    let h = b.volume("mine").expect("volume");
    for start in (0..N).step_by(2048) {
        let data: Vec<u8> = (start..(start + 2048).min(N))
            .flat_map(|i| block(tag(i)))
            .collect();
        h.write_at(start * BS as u64, &data, false).expect("write");
    }
    b.flush().expect("flush");
    let r = b.sync_hosts().expect("sync");
    let merged_at_fold = r.peers[0].chunks_merged;
    assert!(
        merged_at_fold < N / 2,
        "the fold found {merged_at_fold} of {N}: the test needs the sparse index to miss most"
    );
    let m = b.merge_duplicates(1 << 20, &|_, _| {}).expect("merge");
    assert_eq!(m.merged, N - merged_at_fold, "{m:?}");
    // Every record of this host's own segments is dead now: its GC may condemn them all.
    let s = b.stats().expect("stats");
    assert!(
        s.dead_bytes * 100 >= s.data_bytes * 95,
        "{} of this host's {} segment bytes are dead: the merge kept its copy, not the lower slot's",
        s.dead_bytes,
        s.data_bytes
    );
    let mut buf = vec![0u8; N as usize * BS];
    h.read_at(0, &mut buf).expect("read");
    for i in 0..N as usize {
        assert!(
            buf[i * BS..(i + 1) * BS] == block(tag(i as u64))[..],
            "block {i} of mine differs after the merge"
        );
    }
    b.gc(0).expect("gc");
    let v = b.verify(&|_, _| {}).expect("verify");
    assert!(v.is_clean(), "{v:?}");
}

#[test]
fn a_joining_host_takes_the_first_hosts_index_setting() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = tmp.path().join("store");
    std::fs::create_dir_all(&store).expect("store dir");
    let (pa, pb) = (tmp.path().join("a"), tmp.path().join("b"));
    let opts = InitOptions::default();
    Pool::init_remote(&pa, &conf(&store), Durability::Local, CACHE, &opts).expect("init");
    let a = open(&pa);
    let sparse = IndexSetting::Sparse { budget: 1 << 20 };
    a.meta_put(SETTING_KEY, Some(&sparse.encode()))
        .expect("setting");
    a.close().expect("close a");
    drop(a);
    Pool::join_remote(&pb, &conf(&store), CACHE, "host-b", None).expect("join");
    let b = open(&pb);
    let s = b.stats().expect("stats");
    assert_eq!(s.dedup_index_mode, "sparse");
    assert_eq!(s.dedup_index_budget_bytes, 1 << 20);
    // The first host stays the owner of its part: b holds no lease on it.
    b.close().expect("close b");
    drop(b);
    let a = open(&pa);
    assert_eq!(a.stats().expect("stats").dedup_index_mode, "sparse");
}

/// A record another host only moved (its GC copied it to a new segment and condemned the
/// old one) is pointed at where it went when this host lets go of the old segment, not copied
/// into this host's segments: the block stays stored once (bench/README.md, cluster.sh,
/// "letting go").
#[test]
fn letting_go_of_a_moved_record_points_at_its_new_place() {
    let c = cluster();
    let a = open(&c.a);
    let b = open(&c.b);
    write(&a, "vx", 5000, 768);
    stored_twice_then_merged(&a, &b);
    b.gc(0).expect("gc b"); // b's own copies, merged into a's, go
    a.sync_hosts().expect("sync a");
    b.sync_hosts().expect("sync b");
    assert_eq!(
        b.stats().expect("stats").data_bytes,
        0,
        "b stores nothing of its own"
    );
    // a's GC moves va's live records out of the segments vx shared with them.
    a.delete_volume("vx").expect("delete");
    let g = a.gc(0).expect("gc a");
    assert!(g.chunks_moved > 0 && g.segments_condemned > 0, "{g:?}");
    let r = b.sync_hosts().expect("sync b");
    assert!(r.peers[0].chunks_let_go > 0, "{r:?}");
    assert_eq!(
        b.stats().expect("stats").data_bytes,
        0,
        "b copied records a only moved: {r:?}"
    );
    check(&b, "vb", 1000, 768);
    // a deletes the condemned segments once b let go; vb still reads, through a's new ones.
    let r = a.sync_hosts().expect("sync a");
    assert!(r.segments_deleted > 0, "{r:?}");
    check(&b, "vb", 1000, 768);
    // a deletes va too: its records are dead for a, so b copies them when a's GC condemns.
    a.delete_volume("va").expect("delete va");
    a.gc(0).expect("gc a");
    b.sync_hosts().expect("sync b");
    a.sync_hosts().expect("sync a");
    check(&b, "vb", 1000, 768);
    assert!(
        b.stats().expect("stats").data_bytes > 0,
        "b holds vb's records now"
    );
    b.close().expect("close b");
    drop(b);
    let b = open(&c.b);
    check(&b, "vb", 1000, 768);
    let v = b.verify(&|_, _| {}).expect("verify");
    assert!(v.bad_chunks.is_empty(), "{:?}", v.bad_chunks);
}
